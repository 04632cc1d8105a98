#!/usr/bin/env bash
# Packs what bench/gpu-check.sh runs on a GPU machine into one folder: the CLI and the test binary
# built here (nvcc is on this machine; the lent GPU machine has no package registry, so the
# project's Debian dependencies cannot be installed there), every shared library they load but
# the CUDA driver's, and this system's dynamic loader, so they run on whatever glibc that machine
# has (bench/gpu-check.sh starts them through the carried loader, or with that machine's own
# C library when it is new enough). The device tool carries the
# folder (`carry: ["gpu-bundle"]`; it is git-ignored). Usage: gpu-bundle.sh BUILD OUT
set -euo pipefail
build=${1:?usage: gpu-bundle.sh BUILD OUT}
out=${2:?usage: gpu-bundle.sh BUILD OUT}
for f in "$build/megadecode" "$build/tests/megadecode_tests"; do
  [ -x "$f" ] || { echo "gpu-bundle: $f is missing (build first)" >&2; exit 1; }
done
grep -q 'for .sm_90a.' "$build/ptxas.log" 2>/dev/null ||
  { echo "gpu-bundle: $build has no sm_90a kernels (configure with MEGADECODE_CUDA_ARCHS=90a-real)" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/lib/glibc"
for f in "$build/megadecode" "$build/tests/megadecode_tests"; do
  # Debug sections out, the symbol table kept: cuda-gdb names the functions of a stuck run.
  strip --strip-debug -o "$out/$(basename "$f")" "$f"
  # Every library the binary resolves here (the loader included); the driver's libcuda is the
  # GPU machine's own (cudart is linked statically and loads it at run time).
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}' |
    while read -r lib; do
    case "$(basename "$lib")" in
      ld-linux*|libc.so*|libm.so*) cp -L "$lib" "$out/lib/glibc/" ;;  # the C library's parts
      *) cp -L "$lib" "$out/lib/" ;;
    esac
  done
done
git -C "$(dirname "$0")/.." rev-parse HEAD > "$out/COMMIT"
echo "gpu-bundle: $(du -sh "$out" | cut -f1) in $out: $(cd "$out" && echo megadecode megadecode_tests lib/*.so* lib/glibc/*)"
