#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU (an H200 when the device tool lends one): the GPU tests,
# then the decode benchmark of both CUDA executors, interleaved, against the HBM bandwidth measured
# by a read kernel in the same run, on random weights generated on the device (nothing uploaded):
#   small       the test geometry (a sanity line: launch overheads dominate)
#   kl48        the full Kimi-Linear-48B-A3B geometry (256 experts, ~98 GB bf16), batch 1-8
#   k3-shard16  one GPU's share of Kimi K3 served 16 ways (all 93 layers; collectives excluded;
#               docs/cuda.md "Benchmark geometries")
# Prints one table per preset last and writes gpu-<preset>.json into $OUT (the device tool's
# output folder) or bench/. Budget: GPU_CHECK_SECONDS (default 420) on one H200.
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
# The whole run keeps inside GPU_CHECK_SECONDS (default 420): a benchmark that would start with
# less than a minute left is skipped, and each gets at most what is left.
DEADLINE=${GPU_CHECK_SECONDS:-420}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
# NCCL is loaded at run time (libnccl.so.2): the machine's Python packages may carry one.
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
  2>/dev/null || true)

if [ -x gpu-bundle/megadecode ]; then
  B=gpu-bundle
  echo "== bundle of commit $(cat $B/COMMIT) (this tree: $(git rev-parse HEAD 2>/dev/null || echo '?'))"
  export MD_TEST_DATA_DIR="$PWD/tests" MD_TEST_CACHE_DIR="/tmp/md-test-cache"
  # With the carried C library (any glibc on this machine), else with this machine's own. The
  # probe is a one-step bench on the GPU: it fails on "no CUDA device" when the driver's
  # libcuda did not load under the carried loader.
  libs="$PWD/$B/lib/glibc:$PWD/$B/lib:${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
  libs="$libs:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu:/usr/local/cuda/lib64:$NCCL_DIR"
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
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${LD_LIBRARY_PATH:+:}$NCCL_DIR"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory --format=csv || true

# Each GPU test in its own process under a time limit: a device fault loses the CUDA context for
# the rest of its process, and a hang must not eat the run. Failures are reported, then the
# benchmarks run anyway. MD_REQUIRE_GPU=1: a test that cannot reach the GPU fails, not skips.
echo "== GPU tests ($(elapsed)) =="
export MD_REQUIRE_GPU=1
: > "$OUTDIR/gpu-tests.log"
failed=0
first_fail=""
for t in $("${TESTS[@]}" --gtest_list_tests --gtest_filter='CudaGpu.*' |
           awk '/^[^ ]/{suite=$1} /^  /{print suite $1}'); do
  s0=$(date +%s%N)
  if timeout 60 "${TESTS[@]}" --gtest_filter="$t" >> "$OUTDIR/gpu-tests.log" 2>&1; then
    echo "ok   $t ($(( ($(date +%s%N) - s0) / 1000000 )) ms)"
  else
    rc=$?
    echo "FAIL $t (rc $rc)"
    failed=$((failed + 1))
    [ -z "$first_fail" ] && [ "$rc" != 124 ] && first_fail=$t
  fi
done
echo "GPU tests: $failed failed (log: $OUTDIR/gpu-tests.log)"
grep -E "Failure|error:|trap|Expected|Which is|actual" "$OUTDIR/gpu-tests.log" | head -20 || true
# The first test that failed (not by the time limit) once more under compute-sanitizer's memcheck,
# with this machine's C library: where a kernel faults, it names the kernel and the access.
if [ -n "$first_fail" ] && command -v compute-sanitizer > /dev/null; then
  echo "== compute-sanitizer memcheck: $first_fail ($(elapsed)) =="
  tbin=${TESTS[${#TESTS[@]}-1]}
  LD_LIBRARY_PATH="${B:+$PWD/$B/lib:}$LD_LIBRARY_PATH" timeout 150 compute-sanitizer --tool memcheck \
    --print-limit 20 "$tbin" --gtest_filter="$first_fail" > "$OUTDIR/sanitizer.log" 2>&1 || true
  grep -E "^=+ (Invalid|Error|Program hit|  +at|Address)|Saved host backtrace|ERROR SUMMARY" \
    "$OUTDIR/sanitizer.log" | head -30 || true
fi

for preset in $PRESETS; do
  if [ "$(left)" -lt 60 ]; then echo "== $preset skipped: $(left) s left of $DEADLINE"; continue; fi
  echo "== decode benchmark: $preset ($(elapsed)) =="
  timeout "$(( $(left) < 300 ? $(left) : 300 ))" "${CLI[@]}" bench --preset "$preset" --device cuda --executor megakernel,opbyop \
    --batch 1,2,4,8 --steps 32 --reps 5 --json "$OUTDIR/gpu-$preset.json" 2>&1 |
    tee "/tmp/gpu-$preset.txt" || echo "!! $preset failed"
done
echo "== summary ($(elapsed)) =="
for preset in $PRESETS; do
  echo "-- $preset"
  grep -E '^(weights|== decode|megadecode: error)' "/tmp/gpu-$preset.txt" || true
  sed -n '/^batch/,$p' "/tmp/gpu-$preset.txt" || true
done
