#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU (an H200 when the device tool lends one): the GPU tests,
# then the decode benchmark of both CUDA executors, interleaved, against the HBM bandwidth measured
# by a read kernel in the same run, on random weights generated on the device (nothing uploaded):
#   small       the test geometry (a sanity line: launch overheads dominate)
#   kl48        the full Kimi-Linear-48B-A3B geometry (256 experts, ~98 GB bf16), batch 1-8
#   k3-shard16  one GPU's share of Kimi K3 served 16 ways (all 93 layers; collectives excluded;
#               docs/cuda.md "Benchmark geometries")
# Prints one table per preset last and writes gpu-<preset>.json into $OUT (the device tool's
# output folder) or bench/. Budget: under 8 minutes on one H200.
#
# The lent GPU machine reaches no package registry, so it cannot install the project's Debian
# dependencies to build. Build here and carry the result:
#   make gpu-bundle          (here: build/ for sm_90a, packed into gpu-bundle/)
#   device run: bash bench/gpu-check.sh   with carry ["gpu-bundle"]
# Without gpu-bundle/ the script builds (a machine with the dependencies and nvcc).
# GPU_CHECK_PRESETS overrides the preset list.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
OUTDIR=${OUT:-bench}
PRESETS=${GPU_CHECK_PRESETS:-"small kl48 k3-shard16"}
elapsed() { echo "$(( $(date +%s) - t0 )) s"; }

if [ -x gpu-bundle/megadecode ]; then
  B=gpu-bundle
  echo "== bundle of commit $(cat $B/COMMIT) (this tree: $(git rev-parse HEAD 2>/dev/null || echo '?'))"
  # With the carried C library (any glibc on this machine), else with this machine's own.
  libs="$PWD/$B/lib/glibc:$PWD/$B/lib:${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
  libs="$libs:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu:/usr/local/cuda/lib64"
  RUN=("$PWD/$B/lib/glibc/ld-linux-x86-64.so.2" --library-path "$libs")
  if ! "${RUN[@]}" "$B/megadecode" --help > /dev/null 2>&1; then
    echo "(the carried loader does not start here: this machine's C library runs the bundle)"
    export LD_LIBRARY_PATH="$PWD/$B/lib:${LD_LIBRARY_PATH:-}"
    RUN=()
  fi
  CLI=("${RUN[@]}" "$B/megadecode")
  TESTS=("${RUN[@]}" "$B/megadecode_tests")
  export MD_TEST_DATA_DIR="$PWD/tests" MD_TEST_CACHE_DIR="/tmp/md-test-cache"
else
  JOBS=${JOBS:-$(nproc)}
  make build JOBS="$JOBS" CMAKE_FLAGS="-DMEGADECODE_CUDA_ARCHS=90a-real -DMEGADECODE_BENCH=OFF"
  bash scripts/check-cuda.sh build
  CLI=(build/megadecode)
  TESTS=(build/tests/megadecode_tests)
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory --format=csv || true
echo "== GPU tests ($(elapsed)) =="
"${TESTS[@]}" --gtest_filter='CudaGpu.*:CudaSim.GpuTarget*' 2>&1 | tail -25
for preset in $PRESETS; do
  echo "== decode benchmark: $preset ($(elapsed)) =="
  "${CLI[@]}" bench --preset "$preset" --device cuda --executor megakernel,opbyop \
    --batch 1,2,4,8 --steps 32 --reps 5 --json "$OUTDIR/gpu-$preset.json" |
    tee "/tmp/gpu-$preset.txt" || echo "!! $preset failed"
done
echo "== summary ($(elapsed)) =="
for preset in $PRESETS; do
  echo "-- $preset"
  grep -E '^(weights|== decode)' "/tmp/gpu-$preset.txt" || true
  sed -n '/^batch/,$p' "/tmp/gpu-$preset.txt" || true
done
