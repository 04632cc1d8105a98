#!/usr/bin/env bash
# Checks of the CUDA backend, run by `make test` and `make cuda-archs` (usage: check-cuda.sh BUILD):
#  1. the portability layer: no __shared__, inline assembly, threadIdx/blockIdx/blockDim or
#     warp intrinsics in the kernel sources outside src/kernels/cuda/port (and the simulation);
#  2. when BUILD has the GPU kernels: ptxas reported no spills (BUILD/ptxas.log; the phase kernel
#     may spill up to a budget, below), and the SASS
#     of both kernels for sm_90a / sm_100a still has its bulk async copies (UBLKCP), i.e. the
#     weights stream through the copy engine. cuobjdump comes with the toolkit, or from PyPI
#     (nvidia-cuda-cuobjdump) when the toolkit lacks it.
set -euo pipefail
build="${1:-build}"
cd "$(dirname "$0")/.."
fail=0
# (threadIdx and friends as the device's variables: not a launch configuration's fields.)
bad=$(grep -rnE '__shared__|\basm\b|(^|[^.[:alnum:]_])(threadIdx|blockIdx|blockDim|gridDim)\b|__shfl|__syncthreads|__ballot' \
        src/kernels/cuda src/exec/cuda --include='*.cu' --include='*.cuh' --include='*.h' \
        --include='*.cpp' | grep -vE '^src/kernels/cuda/(port|sim)/' || true)
if [ -n "$bad" ]; then
  echo "check-cuda: hardware access outside the portability layer (src/kernels/cuda/port):"
  echo "$bad"
  fail=1
fi
obj=$(find "$build" -name 'kernels.cu.o' -path '*megadecode_cuda_gpu*' 2>/dev/null | head -1)
if [ -z "$obj" ]; then
  echo "check-cuda: portability layer ok; no GPU kernels in $build (built without nvcc)"
  exit $fail
fi
if [ -f "$build/ptxas.log" ]; then
  # No kernel may spill, except the phase kernel up to a budget: with the distributed tiles
  # (2026-12-04) it spills 44 B at ptxas's 255-register limit, and the SASS's line info puts every
  # spill access in per-call prologues (the weight lookup, the prefetch's bookkeeping, the tiles'
  # entry), none in a GEMV chunk loop (docs/cuda.md, "ptxas"). The megakernel: none at all.
  phase_budget=64
  spills=$(awk -v budget="$phase_budget" '
    /Function properties for/ { fn = $NF }
    /bytes spill stores/ {
      st = $(NF - 7) + 0; ld = $(NF - 3) + 0
      if (st == 0 && ld == 0) next
      if (fn ~ /phase_kernel/ && st <= budget) next
      print fn ": " $0
    }' "$build/ptxas.log")
  if [ -n "$spills" ]; then
    echo "check-cuda: ptxas reports spills (the phase kernel may spill up to $phase_budget B):"
    echo "$spills"
    fail=1
  fi
else
  echo "check-cuda: $build/ptxas.log missing (the kernels were built before the log existed?)"
fi
cuobjdump=$(command -v cuobjdump || true)
[ -z "$cuobjdump" ] && [ -x /usr/local/cuda/bin/cuobjdump ] && cuobjdump=/usr/local/cuda/bin/cuobjdump
if [ -z "$cuobjdump" ]; then
  venv="$build/cuda-tools-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q nvidia-cuda-cuobjdump
  cuobjdump=$(find "$venv" -name cuobjdump -type f | head -1)
fi
# cuobjdump -sass needs nvdisasm, which the toolkit image may lack: from PyPI then.
if ! command -v nvdisasm > /dev/null && [ ! -x "$(dirname "$cuobjdump")/nvdisasm" ]; then
  venv="$build/cuda-tools-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  [ -n "$(find "$venv" -name nvdisasm -type f 2>/dev/null)" ] || "$venv/bin/pip" install -q nvidia-cuda-nvdisasm
  PATH="$(dirname "$(find "$venv" -name nvdisasm -type f | head -1)"):$PATH"
  export PATH
fi
for arch in $("$cuobjdump" --list-elf "$obj" | grep -oE 'sm_[0-9]+a?' | sort -u); do
  case "$arch" in sm_80) continue ;; esac  # no bulk copies before Hopper (the fallback)
  sass=$("$cuobjdump" -sass -arch "$arch" "$obj")
  for k in megakernel phase_kernel; do
    n=$(echo "$sass" | awk -v k="$k" '/Function :/ {f = index($0, k) > 0} f && /UBLKCP/ {n++} END {print n + 0}')
    if [ "$n" -eq 0 ]; then
      echo "check-cuda: $k for $arch has no bulk async copy (UBLKCP) left"
      fail=1
    else
      echo "check-cuda: $k $arch: $n bulk async copies"
    fi
  done
done
[ $fail -eq 0 ] && echo "check-cuda: ok"
exit $fail
