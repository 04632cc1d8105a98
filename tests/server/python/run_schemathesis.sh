#!/usr/bin/env bash
# A bounded schemathesis run against `megadecode serve`'s /openapi.json: generated requests
# (valid and invalid) to every route; fails on a 5xx, a crash, an undocumented status or a
# response that violates the schema. The virtual environment (pinned schemathesis) is made once
# from PyPI; exit 77 (ctest: skipped) when it cannot be made, e.g. offline.
# usage: run_schemathesis.sh MEGADECODE_BINARY VENV_DIR [MAX_EXAMPLES]
set -uo pipefail
bin=$1 venv=$2 examples=${3:-20}
if [ ! -x "$venv/bin/st" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" >/dev/null 2>&1 &&
    "$venv/bin/pip" install -q --disable-pip-version-check "schemathesis==3.38.10" \
      "hypothesis==6.118.0" >/dev/null 2>&1 ||
    { echo "cannot make the schemathesis virtual environment (offline?): skipped"; rm -rf "$venv"; exit 77; }
fi
dir=$(mktemp -d)
"$bin" make-model --preset tiny --seed 3 --out "$dir/model" --force >/dev/null || exit 1
"$bin" serve --model "$dir/model" --port 0 --workers 1 --max-model-len 512 2> "$dir/log" >/dev/null &
pid=$!
trap 'kill "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
port=""
for _ in $(seq 600); do
  port=$(grep -o 'http://127.0.0.1:[0-9]*' "$dir/log" | head -1 | sed 's/.*://')
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "serve did not start:"; cat "$dir/log"; exit 1; }
cd "$dir" && "$venv/bin/st" run "http://127.0.0.1:$port/openapi.json" --checks all \
  --hypothesis-max-examples "$examples" --hypothesis-seed 1 --hypothesis-deadline none \
  --show-trace 2>&1 | tail -25
rc=${PIPESTATUS[0]}
kill -TERM "$pid"
wait "$pid" || { echo "serve exited with $?"; rc=1; }
exit "$rc"
