#!/usr/bin/env bash
# make soak: `megadecode serve` on a model under SOAK_CLIENTS streaming clients for SOAK_SECONDS
# (loopback only), then SIGTERM. Each request picks one of the streaming routes (completions,
# chat, responses, messages; SOAK_ENDPOINT=NAME for one). Fails on any client error or a serve exit status other than 0;
# prints requests served and the server's RSS at start and end.
# usage: soak.sh BINARY MODEL_DIR SECONDS CLIENTS
set -euo pipefail
bin=$1 model=$2 seconds=$3 clients=$4
log=$(mktemp)
"$bin" serve --model "$model" --port 0 --max-batch 8 --max-queue 128 --http-threads 128 \
  2> "$log" > /dev/null &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
port=""
for _ in $(seq 600); do
  port=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 | sed 's/.*://') || true
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "serve did not start:"; cat "$log"; exit 1; }
rc=0
python3 "$(dirname "$0")/../bench/serve_bench.py" --port "$port" --soak "$seconds" \
  --concurrency "$clients" --input-len 32 --output-len 32 --server-pid "$pid" \
  --endpoint "${SOAK_ENDPOINT:-mixed}" || rc=1
kill -TERM "$pid"
wait "$pid" || { echo "serve exited with $?"; rc=1; }
trap - EXIT
rm -f "$log"
exit $rc
