#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU (an H200 when the device tool lends one): the GPU tests,
# then the decode benchmark of both CUDA executors, interleaved, against the HBM bandwidth measured
# by a read kernel in the same run, on random weights generated on the device (nothing uploaded):
#   small       the test geometry (a sanity line: launch overheads dominate)
#   kl48        the full Kimi-Linear-48B-A3B geometry (256 experts, ~98 GB bf16), batch 1-8
#   k3-shard16  one GPU's share of Kimi K3 served 16 ways (all 93 layers; collectives excluded;
#               docs/cuda.md "Benchmark geometries")
#   kl48:int4, kl48:int8  kl48 with its linears drawn in a quantized format on the device
#               (--quantize: random codes and group scales; the bytes a quantized model reads)
# Prints one table per preset last and writes gpu-<preset>[-<scheme>].json into $OUT (the device tool's
# output folder) or bench/.
#
# The lent GPU machine reaches no package registry, so it cannot install the project's Debian
# dependencies to build. Build here and carry the result:
#   make gpu-bundle          (here: build/ for sm_90a, packed into gpu-bundle/)
#   device run: bash bench/gpu-check.sh   with carry ["gpu-bundle"]
# Without gpu-bundle/ the script builds (a machine with the dependencies and nvcc).
#
# Settings (environment):
#   GPU_CHECK_SECONDS  the whole run's budget (default 420). A benchmark that would start with less
#                      than a minute left is skipped; each gets at most what is left.
#   GPU_CHECK_TESTS    gtest filter of the GPU tests (default CudaGpu.*; "-" runs none)
#   GPU_CHECK_PRESETS  presets to benchmark, each PRESET or PRESET:SCHEME (--quantize SCHEME)
#                      (default "small kl48 kl48:int4 kl48:int8 k3-shard16")
#   GPU_CHECK_BATCHES  batch sizes (default 1,2,4,8); GPU_CHECK_STEPS / GPU_CHECK_REPS (32 / 5)
#   GPU_CHECK_PRESET_SECONDS  the most one preset's benchmark may take (default 300). A benchmark
#                      still running then has its threads' stacks (and the device's kernels)
#                      printed by cuda-gdb into stack-<preset>.txt before it is stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
OUTDIR=${OUT:-bench}
PRESETS=${GPU_CHECK_PRESETS:-"small kl48 kl48:int4 kl48:int8 k3-shard16"}
FILTER=${GPU_CHECK_TESTS:-"CudaGpu.*"}
BATCHES=${GPU_CHECK_BATCHES:-1,2,4,8}
STEPS=${GPU_CHECK_STEPS:-32}
REPS=${GPU_CHECK_REPS:-5}
PRESET_SECONDS=${GPU_CHECK_PRESET_SECONDS:-300}
DEADLINE=${GPU_CHECK_SECONDS:-420}
elapsed() { echo "$(( $(date +%s) - t0 )) s"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
# NCCL is loaded at run time (libnccl.so.2): the machine's Python packages may carry one.
NCCL_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
  2>/dev/null || true)

if [ -x gpu-bundle/megadecode ]; then
  B=gpu-bundle
  echo "== bundle of commit $(cat $B/COMMIT) (this tree: $(git rev-parse HEAD 2>/dev/null || echo '?'))"
  export MD_TEST_DATA_DIR="$PWD/tests" MD_TEST_CACHE_DIR="/tmp/md-test-cache"
  # With this machine's own C library first (its libnccl may need a newer glibc than the carried
  # one: seen on an H200 machine, 2026-12-04, GLIBC_2.38), else with the carried loader and C
  # library. The probe is a one-step bench on the GPU: it fails on "no CUDA device" when the
  # driver's libcuda did not load.
  probe() {
    timeout 120 "${RUN[@]}" "$B/megadecode" bench --preset tiny --device cuda --executor opbyop \
      --batch 1 --steps 1 --reps 1 > /tmp/gpu-probe.txt 2>&1
  }
  export LD_LIBRARY_PATH="$PWD/$B/lib:${LD_LIBRARY_PATH:-}${NCCL_DIR:+:$NCCL_DIR}"
  RUN=()
  if ! probe; then
    echo "(this machine's C library: $(tail -1 /tmp/gpu-probe.txt); trying the carried loader)"
    libs="$PWD/$B/lib/glibc:$LD_LIBRARY_PATH:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
    libs="$libs:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu:/usr/local/cuda/lib64"
    RUN=("$PWD/$B/lib/glibc/ld-linux-x86-64.so.2" --library-path "$libs")
    probe || echo "!! the GPU probe failed: $(tail -1 /tmp/gpu-probe.txt)"
  fi
  CLI=("${RUN[@]}" "$B/megadecode")
  TESTS=("${RUN[@]}" "$B/megadecode_tests")
else
  JOBS=${JOBS:-$(nproc)}
  make build JOBS="$JOBS" CMAKE_FLAGS="-DMEGADECODE_CUDA_ARCHS=90a-real -DMEGADECODE_BENCH=OFF"
  bash scripts/check-cuda.sh build
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${NCCL_DIR:+:$NCCL_DIR}"
  CLI=(build/megadecode)
  TESTS=(build/tests/megadecode_tests)
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory,clocks.sm,temperature.gpu,power.draw \
  --format=csv || true

# Each GPU test in its own process under a time limit: a device fault loses the CUDA context for
# the rest of its process, and a hang must not eat the run. Failures are reported, then the
# benchmarks run anyway. MD_REQUIRE_GPU=1: a test that cannot reach the GPU fails, not skips.
if [ "$FILTER" != "-" ]; then
  echo "== GPU tests ($(elapsed)) =="
  export MD_REQUIRE_GPU=1
  : > "$OUTDIR/gpu-tests.log"
  failed=0
  first_fail=""
  for t in $("${TESTS[@]}" --gtest_list_tests --gtest_filter="$FILTER" |
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
  grep -E "Failure|error:|trap|Expected|Which is|actual|exception" "$OUTDIR/gpu-tests.log" |
    head -20 || true
  # The first test that failed (not by the time limit) once more under compute-sanitizer's
  # memcheck: where a kernel faults, it names the kernel and the access.
  if [ -n "$first_fail" ] && command -v compute-sanitizer > /dev/null; then
    echo "== compute-sanitizer memcheck: $first_fail ($(elapsed)) =="
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "${TESTS[@]}" \
      --gtest_filter="$first_fail" > "$OUTDIR/sanitizer.log" 2>&1 || true
    grep -E "^=+ (Invalid|Error|  +at|Address)|ERROR SUMMARY|OK|FAILED" "$OUTDIR/sanitizer.log" |
      head -30 || true
  fi
fi

# Runs "$@" for at most $2 seconds; past that, cuda-gdb prints its threads' stacks and the
# device's kernels into stack-$1.txt, then it is stopped.
bounded() {
  local name=$1 limit=$2
  shift 2
  "$@" &
  local pid=$! waited=0
  while kill -0 "$pid" 2> /dev/null && [ "$waited" -lt "$limit" ]; do
    sleep 1
    waited=$((waited + 1))
  done
  if kill -0 "$pid" 2> /dev/null; then
    echo "!! $name still running after $limit s: stacks into $OUTDIR/stack-$name.txt"
    timeout 45 cuda-gdb -p "$pid" -batch -ex "info cuda kernels" -ex "thread apply all bt 16" \
      > "$OUTDIR/stack-$name.txt" 2>&1 || true
    grep -E "^#[0-9]+ .* in md::" "$OUTDIR/stack-$name.txt" | head -12 || true
    kill -9 "$pid" 2> /dev/null || true
  fi
  wait "$pid"
}

# An entry's name (gpu-NAME.json): PRESET, or PRESET-SCHEME.
name_of() { echo "${1/:/-}"; }
for entry in $PRESETS; do
  preset=${entry%%:*}
  name=$(name_of "$entry")
  quant=()
  [ "$entry" != "$preset" ] && quant=(--quantize "${entry#*:}")
  if [ "$(left)" -lt 60 ]; then echo "== $name skipped: $(left) s left of $DEADLINE"; continue; fi
  limit=$(( $(left) - 15 < PRESET_SECONDS ? $(left) - 15 : PRESET_SECONDS ))
  echo "== decode benchmark: $name ($(elapsed); at most $limit s) =="
  bounded "$name" "$limit" "${CLI[@]}" bench --preset "$preset" "${quant[@]}" --device cuda \
    --executor megakernel,opbyop --batch "$BATCHES" --steps "$STEPS" --reps "$REPS" \
    --json "$OUTDIR/gpu-$name.json" > "/tmp/gpu-$name.txt" 2> "/tmp/gpu-$name.err" ||
    echo "!! $name failed: $(tr '\r' '\n' < "/tmp/gpu-$name.err" | tail -2 | tr '\n' ' ')"
  grep -E '^quantized' "/tmp/gpu-$name.err" || true
  cat "/tmp/gpu-$name.txt"
done
echo "== summary ($(elapsed)) =="
for entry in $PRESETS; do
  name=$(name_of "$entry")
  echo "-- $name"
  [ -f "/tmp/gpu-$name.txt" ] || continue
  grep -E '^(weights|plan executors|== decode|megadecode: error)' "/tmp/gpu-$name.txt" || true
  sed -n '/^batch/,$p' "/tmp/gpu-$name.txt" || true
done
