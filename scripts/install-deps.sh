#!/usr/bin/env bash
# Installs the Debian packages megadecode builds against, skipping those already present.
# Usage: install-deps.sh [--fuzz]
set -euo pipefail
pkgs=(cmake ninja-build g++ make pkg-config nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
      libpcre2-dev libcpp-httplib-dev libgtest-dev libgmock-dev libbenchmark-dev
      libopenmpi-dev openmpi-bin)
# --fuzz (make fuzz): also clang and compiler-rt, whose libclang_rt.fuzzer is libFuzzer. Only the
# fuzz build needs them; make test builds the harnesses' replay tests with g++.
if [ "${1:-}" = "--fuzz" ]; then
  pkgs+=(clang libclang-rt-14-dev)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
