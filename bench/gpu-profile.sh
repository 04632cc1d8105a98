#!/usr/bin/env bash
# Where the CUDA op-by-op phases of one decode step spend their time, on a lent GPU (the device
# tool; carry ["gpu-bundle"], as bench/gpu-check.sh). Two Nsight Compute passes over a bench of
# PRESET (default kl48-e32: kl48's layer shapes and active bytes per token, 12.6 GB of weights, so
# that ncu's kernel replay can save and restore the device memory; on kl48's 98 GB one replayed
# kernel took over a minute, 2026-12-04):
#   1. every phase kernel of the first steps, timed (gpu__time_duration) -> ncu-times.csv; a
#      step's phases in the plan's order (megadecode plan --preset P --workers <SMs> lists them);
#   2. phases FIRST .. FIRST + COUNT - 1 of the first step (default: layer 1's kda_proj, kda_core,
#      attn_out, ffn_norm, router_logits, router + shared gate/up, expert gate/up + shared down;
#      `plan --preset kl48-e32 --workers 132 --dump` lists the phases) with the sections that say why: speed of light, warp states, occupancy
#      and the per-instruction stall samples (SourceCounters) -> ncu-layer.txt. Each replayed
#      kernel backs up the device memory (12.6 GB here), so keep COUNT small.
# Two files come back in $OUT (the device tool returns at most 8 a call, gpu-check.sh's included).
# Budget: about 4 minutes. Settings: PRESET, FIRST (8), COUNT (7), TIMED (600 kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-bench}
PRESET=${PRESET:-kl48-e32}
FIRST=${FIRST:-8}
COUNT=${COUNT:-7}
TIMED=${TIMED:-600}
B=gpu-bundle
[ -x "$B/megadecode" ] || { echo "gpu-profile: carry gpu-bundle (make gpu-bundle)" >&2; exit 1; }
export LD_LIBRARY_PATH="$PWD/$B/lib:${LD_LIBRARY_PATH:-}"
# --context 1: the first plan step (the prompt's one token) has a decode step's shape.
BENCH=("$B/megadecode" bench --preset "$PRESET" --device cuda --executor opbyop --batch 1
       --steps 2 --reps 1 --context 1)
t0=$(date +%s)
echo "== timed phases ($PRESET) =="
timeout 150 ncu --clock-control none -k regex:phase_kernel --metrics gpu__time_duration.sum \
  --launch-count "$TIMED" --csv --log-file "$OUTDIR/ncu-times.csv" "${BENCH[@]}" \
  > /tmp/ncu-bench.txt 2>&1 || echo "!! timed pass: rc $?: $(tail -1 /tmp/ncu-bench.txt)"
python3 - "$OUTDIR/ncu-times.csv" << 'EOF' || true
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr, data = rows[0], rows[1:]
i = hdr.index("Metric Value")
us = [float(r[i].replace(",", "")) / 1e3 for r in data]
print(f"{len(us)} phase kernels, {sum(us) / 1e3:.2f} ms; the first 40 (us):")
print(" ".join(f"{u:.0f}" for u in us[:40]))
EOF
echo "== one layer's phases with the stall sections ($(( $(date +%s) - t0 )) s) =="
timeout 200 ncu --clock-control none -k regex:phase_kernel --launch-skip "$FIRST" \
  --launch-count "$COUNT" --section SpeedOfLight --section WarpStateStats --section LaunchStats \
  --section Occupancy --section SourceCounters \
  --log-file "$OUTDIR/ncu-layer.txt" "${BENCH[@]}" > /dev/null 2>&1 || echo "!! layer pass: rc $?"
grep -E "Duration|Memory Throughput|DRAM Throughput|Stall|Warp Cycles Per Issued|Achieved Occupancy|Registers Per" \
  "$OUTDIR/ncu-layer.txt" | head -80 || true
echo "== done ($(( $(date +%s) - t0 )) s)"
