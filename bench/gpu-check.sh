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
  export MD_TEST_DATA_DIR="$PWD/tests" MD_TEST_CACHE_DIR="/tmp/md-test-cache"
  # With the carried C library (any glibc on this machine), else with this machine's own. The
  # probe is a one-step bench on the GPU: it fails on "no CUDA device" when the driver's
  # libcuda did not load under the carried loader.
  libs="$PWD/$B/lib/glibc:$PWD/$B/lib:${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
  libs="$libs:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu:/usr/local/cuda/lib64"
  RUN=("$PWD/$B/lib/glibc/ld-linux-x86-64.so.2" --library-path "$libs")
  probe() {
    timeout 120 "${RUN[@]}" "$B/megadecode" bench --preset tiny --device cuda --executor opbyop \
      --batch 1 --steps 1 --reps 1 > /tmp/gpu-probe.txt 2>&1
  }
  if ! probe; then
    echo "(the carried loader: $(tail -1 /tmp/gpu-probe.txt); trying this machine's C library)"
    export LD_LIBRARY_PATH="$PWD/$B/lib:${LD_LIBRARY_PATH:-}"
    RUN=()
    probe || echo "!! the GPU probe failed: $(tail -1 /tmp/gpu-probe.txt)"
  fi
  CLI=("${RUN[@]}" "$B/megadecode")
  TESTS=("${RUN[@]}" "$B/megadecode_tests")
else
  JOBS=${JOBS:-$(nproc)}
  make build JOBS="$JOBS" CMAKE_FLAGS="-DMEGADECODE_CUDA_ARCHS=90a-real -DMEGADECODE_BENCH=OFF"
  bash scripts/check-cuda.sh build
  CLI=(build/megadecode)
  TESTS=(build/tests/megadecode_tests)
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory --format=csv || true

# Each GPU test in its own process under a time limit: a device fault loses the CUDA context for
# the rest of its process, and a hang must not eat the run. Failures are reported, then the
# benchmarks run anyway. MD_REQUIRE_GPU=1: a test that cannot reach the GPU fails, not skips.
echo "== GPU tests ($(elapsed)) =="
export MD_REQUIRE_GPU=1
: > "$OUTDIR/gpu-tests.log"
failed=0
for t in $("${TESTS[@]}" --gtest_list_tests --gtest_filter='CudaGpu.*' |
           awk '/^[^ ]/{suite=$1} /^  /{print suite $1}'); do
  if timeout 120 "${TESTS[@]}" --gtest_filter="$t" >> "$OUTDIR/gpu-tests.log" 2>&1; then
    echo "ok   $t"
  else
    echo "FAIL $t (rc $?)"
    failed=$((failed + 1))
  fi
done
echo "GPU tests: $failed failed (log: $OUTDIR/gpu-tests.log)"
grep -E "Failure|error:|trap|Expected|Which is|actual" "$OUTDIR/gpu-tests.log" | head -20 || true

for preset in $PRESETS; do
  echo "== decode benchmark: $preset ($(elapsed)) =="
  timeout 300 "${CLI[@]}" bench --preset "$preset" --device cuda --executor megakernel,opbyop \
    --batch 1,2,4,8 --steps 32 --reps 5 --json "$OUTDIR/gpu-$preset.json" 2>&1 |
    tee "/tmp/gpu-$preset.txt" || echo "!! $preset failed"
done
echo "== summary ($(elapsed)) =="
for preset in $PRESETS; do
  echo "-- $preset"
  grep -E '^(weights|== decode|megadecode: error)' "/tmp/gpu-$preset.txt" || true
  sed -n '/^batch/,$p' "/tmp/gpu-$preset.txt" || true
done
