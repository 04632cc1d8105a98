#!/usr/bin/env bash
# `make fuzz`: builds the libFuzzer harnesses of tests/fuzz with clang in their own build directory
# and runs each for FUZZ_SECONDS. Fails (exit 1) when any harness finds a crash, a sanitizer
# report, a timeout or an escaped exception; the reproducer is left in $FUZZ_BUILD/artifacts/.
# New corpus entries go to $FUZZ_BUILD/fuzz-corpus/<name>; the committed seeds are only read.
# Environment: FUZZ_BUILD (build-fuzz), FUZZ_SECONDS (60), FUZZERS (all), JOBS (nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${FUZZ_BUILD:-build-fuzz}
seconds=${FUZZ_SECONDS:-60}
fuzzers=${FUZZERS:-safetensors config tokenizer chat}
jobs=${JOBS:-$(nproc)}

bash scripts/install-deps.sh --fuzz
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMEGADECODE_FUZZ=ON -DMEGADECODE_TESTS=OFF -DMEGADECODE_BENCH=OFF > /dev/null
targets=()
for f in $fuzzers; do targets+=("fuzz_$f"); done
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

failed=()
mkdir -p "$build/artifacts"
for f in $fuzzers; do
  mkdir -p "$build/fuzz-corpus/$f"
  args=(-max_total_time="$seconds" -timeout=10 -print_final_stats=1
        -artifact_prefix="$build/artifacts/$f-")
  [ -f "tests/fuzz/dict/$f.dict" ] && args+=(-dict="tests/fuzz/dict/$f.dict")
  echo "== fuzz_$f: ${seconds}s =="
  # The log is kept for a failure report; libFuzzer's progress lines would drown the summary.
  log="$build/artifacts/$f.log"
  if "$build/tests/fuzz/fuzz_$f" "${args[@]}" "$build/fuzz-corpus/$f" "tests/fuzz/corpus/$f" \
      > "$log" 2>&1; then
    grep -E '^(stat::number_of_executed_units|stat::new_units_added)' "$log" || true
  else
    echo "fuzz_$f FAILED (log: $log):"
    grep -E -A30 '^==[0-9]+==|runtime error|deadly signal|Test unit written|uncaught' "$log" \
      | head -60 || tail -40 "$log"
    failed+=("$f")
  fi
done
if ((${#failed[@]})); then
  echo "fuzzers with findings: ${failed[*]}"
  exit 1
fi
echo "all fuzzers ran ${seconds}s without findings: $fuzzers"
