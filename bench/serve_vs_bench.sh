#!/usr/bin/env bash
# Serving overhead, measured the way issue 11 states its target: output tokens/s of `serve` under
# bench/serve_bench.py at concurrency B against `megadecode bench` at batch B, same context (a
# --input-len prompt, --output-len steps), in the same session. The two alternate REPS times per
# level (bench, then a fresh server and its client), so a drift of the host's memory bandwidth
# lands on both; it prints every pair and, per level, the medians and the median of the pairs'
# ratios.
#
# usage: bench/serve_vs_bench.sh BINARY MODEL_DIR [REPS] [LEVELS] [OUTPUT_LEN] [REQUESTS] [-- SERVE_FLAGS...]
#   e.g. bench/serve_vs_bench.sh build/megadecode models/small 5 1,2,4,8 256 32
# BENCH_REPS (default 5): the bench's interleaved repetitions per pair (fewer for a big model).
# CLIENT (default cpp): `megadecode serve-bench`, the C++ load client; python: bench/serve_bench.py
# (same requests and columns, about 4x the client CPU).
set -euo pipefail
bin=$1 model=$2 reps=${3:-5} levels=${4:-1,2,4,8} out_len=${5:-256} requests=${6:-32}
shift $(( $# < 6 ? $# : 6 ))
[ "${1:-}" = "--" ] && shift
serve_flags=("$@")
in_len=16
here=$(cd "$(dirname "$0")" && pwd)
log=$(mktemp)
results=$(mktemp)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -f "$log" "$results"' EXIT

for b in ${levels//,/ }; do
  for r in $(seq "$reps"); do
    line=$("$bin" bench --model "$model" --what decode --batch "$b" --executor megakernel \
             --context "$in_len" --steps "$out_len" --reps "${BENCH_REPS:-5}" 2>&1)
    bw=$(grep -o 'read bandwidth median [0-9.]*' <<<"$line" | awk '{print $4}')
    bench_tps=$(awk -v b="$b" '$1 == b && $2 == "megakernel" {print $4}' <<<"$line")
    "$bin" serve --model "$model" --port 0 --max-batch 8 "${serve_flags[@]}" 2>"$log" >/dev/null &
    pid=$!
    port=""
    for _ in $(seq 3000); do  # a large checkpoint takes a while to map
      port=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 | sed 's/.*://') || true
      [ -n "$port" ] && break
      sleep 0.1
    done
    [ -n "$port" ] || { echo "serve did not start:"; cat "$log"; exit 1; }
    if [ "${CLIENT:-cpp}" = python ]; then
      client=(python3 "$here/serve_bench.py")
    else
      client=("$bin" serve-bench)
    fi
    row=$("${client[@]}" --port "$port" --input-len "$in_len" \
            --output-len "$out_len" --concurrency "$b" --num-requests "$requests" | tail -1)
    kill -INT "$pid"; wait "$pid" || true; pid=""
    serve_tps=$(awk '{print $3}' <<<"$row")
    grep -q errors <<<"$row" && { echo "client errors: $row"; exit 1; }
    echo "batch $b rep $r: bench $bench_tps tok/s (read bw $bw GB/s), serve $serve_tps tok/s" \
         "(ttft p50 $(awk '{print $4}' <<<"$row") ms, itl p50/p99 $(awk '{print $6"/"$7}' <<<"$row") ms)"
    echo "$b $bench_tps $serve_tps" >> "$results"
  done
done
python3 - "$results" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print(f"{'batch':>5} {'bench tok/s':>12} {'serve tok/s':>12} {'median serve/bench':>19}")
for b in sorted({int(r[0]) for r in rows}):
    mine = [(float(r[1]), float(r[2])) for r in rows if int(r[0]) == b]
    print(f"{b:>5} {statistics.median(x for x, _ in mine):>12.1f} "
          f"{statistics.median(y for _, y in mine):>12.1f} "
          f"{statistics.median(y / x for x, y in mine):>19.3f}")
EOF
