#!/usr/bin/env bash
# The official clients' checks (openai_client_check.py, anthropic_client_check.py) in a virtual
# environment of their own, made once from PyPI (pinned openai and anthropic). Exit 77 (ctest: skipped) when the
# environment cannot be made, e.g. offline.
# usage: run_openai_check.sh MEGADECODE_BINARY VENV_DIR
set -uo pipefail
bin=$1 venv=$2
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -x "$venv/bin/python" ] ||
  ! "$venv/bin/python" -c "import openai, anthropic, pydantic
assert openai.__version__ == '3.63.0' and anthropic.__version__ == '2.17.0'" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv" >/dev/null 2>&1 &&
    "$venv/bin/pip" install -q --disable-pip-version-check "openai==3.63.0" "anthropic==2.17.0" "httpx==0.28.1" "pydantic==2.14.4" >/dev/null 2>&1 ||
    { echo "cannot make the openai virtual environment (offline?): skipped"; rm -rf "$venv"; exit 77; }
fi
model=$(mktemp -d)
trap 'rm -rf "$model"' EXIT
"$bin" make-model --preset tiny --seed 3 --out "$model" --force >/dev/null || exit 1
"$venv/bin/python" "$here/openai_client_check.py" "$bin" "$model" &&
  "$venv/bin/python" "$here/anthropic_client_check.py" "$bin" "$model"
