#!/usr/bin/env bash
# The launch path: `mpirun -np 2 megadecode generate --tp 2` (and --ep 2) prints the tokens of
# the single process on the golden `small` model (its greedy run's clean stretch, golden.json:
# the steps before the first router near-tie, where no reordering can flip an expert), only
# once (rank 0 writes), and a layout that does not fit the run is a one-line error, not a hang.
# Usage: cli_generate.sh MPIEXEC MEGADECODE TESTS_DIR
set -u
mpiexec="$1"; cli="$2"; model="$3/data/golden/small"
ids=$(python3 -c "import json; print(','.join(map(str, json.load(open('$model/golden.json'))['greedy']['prompt_ids'])))")
clean=$(python3 -c "import json; print(json.load(open('$model/golden.json'))['greedy']['clean_steps'])")
want=$(python3 -c "import json; g=json.load(open('$model/golden.json'))['greedy']; print(' '.join(map(str, g['tokens'][:g['clean_steps']])))")
# run LAYOUT-FLAGS LAUNCHER...: generate the clean stretch greedily
run() { local flags="$1"; shift
        timeout 120 "$@" generate --model "$model" $flags --executor megakernel --ids "$ids" \
          --max-tokens "$clean" --ignore-eos 2>/tmp/md-cli-generate.err; }
fail=0
single=$(run "" "$cli")
[ "$single" = "$want" ] || { echo "FAIL: the single process is not the golden run: $single"; fail=1; }
for layout in "--tp 2" "--ep 2"; do
  out=$(run "$layout" "$mpiexec" --oversubscribe -np 2 "$cli")
  rc=$?
  if [ $rc -ne 0 ] || [ "$out" != "$want" ]; then
    echo "FAIL: mpirun -np 2 generate $layout (status $rc): '$out'"; cat /tmp/md-cli-generate.err; fail=1
  else
    echo "ok: mpirun -np 2 generate $layout prints the golden tokens once"
  fi
done
out=$(timeout 60 "$mpiexec" --oversubscribe -np 2 "$cli" generate --model "$model" --tp 3 \
        --executor megakernel --ids 1,2 --max-tokens 2 2>&1)
rc=$?
if [ $rc -eq 0 ] || [ $rc -eq 124 ] || ! grep -q "needs 3 ranks, and this run has 2" <<<"$out"; then
  echo "FAIL: --tp 3 on 2 ranks (status $rc): $out"; fail=1
else
  echo "ok: --tp 3 on 2 ranks is an error naming the rank count"
fi
exit $fail
