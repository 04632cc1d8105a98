#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU (an H200 when the device tool lends one), from a fresh
# checkout: build for sm_90a, the GPU tests, then the decode benchmark of both CUDA executors,
# interleaved, against the HBM bandwidth measured by a read kernel in the same run, on random
# weights generated on the device (nothing uploaded):
#   small       the test geometry (a sanity line: launch overheads dominate)
#   kl48        the full Kimi-Linear-48B-A3B geometry (256 experts, ~98 GB bf16), batch 1-8
#   k3-shard16  one GPU's share of Kimi K3 served 16 ways (all 93 layers; collectives excluded;
#               the geometry in docs/cuda.md "Benchmark geometries")
# Prints one table last and writes bench/gpu-<preset>.json. Budget: under 8 minutes on one H200.
# GPU_CHECK_PRESETS overrides the list.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
JOBS=${JOBS:-$(nproc)}
PRESETS=${GPU_CHECK_PRESETS:-"small kl48 k3-shard16"}
make build JOBS="$JOBS" CMAKE_FLAGS="-DMEGADECODE_CUDA_ARCHS=90a-real -DMEGADECODE_BENCH=OFF"
bash scripts/check-cuda.sh build
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
echo "== GPU tests ($(( $(date +%s) - t0 )) s) =="
build/tests/megadecode_tests --gtest_filter='CudaGpu.*:CudaSim.GpuTarget*'
for preset in $PRESETS; do
  echo "== decode benchmark: $preset ($(( $(date +%s) - t0 )) s) =="
  build/megadecode bench --preset "$preset" --device cuda --executor megakernel,opbyop \
    --batch 1,2,4,8 --steps 32 --reps 5 --json "bench/gpu-$preset.json" | tee "/tmp/gpu-$preset.txt"
done
echo "== summary ($(( $(date +%s) - t0 )) s) =="
for preset in $PRESETS; do
  echo "-- $preset"
  grep -E '^(weights|== decode)' "/tmp/gpu-$preset.txt" || true
  sed -n '/^batch/,$p' "/tmp/gpu-$preset.txt"
done
