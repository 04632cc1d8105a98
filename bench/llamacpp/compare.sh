#!/usr/bin/env bash
# megadecode against llama.cpp on the same weights, in one run (issue 14's benchmark targets).
#
#   bench/llamacpp/compare.sh MODEL_DIR [STEP...]
#
# Steps (default: all, in this order):
#   setup    unpack llama.cpp from PyPI's llama-cpp-python sdist (pinned below) and build its
#            llama-bench, llama-batched-bench, llama-quantize and llama-perplexity for this CPU;
#            a Python venv with its converter's packages (torch, transformers, ...)
#   convert  MODEL_DIR -> bf16 GGUF (bench/llamacpp/hf_to_gguf.py), then Q4_K_M and Q8_0 with
#            llama-quantize; and megadecode's int4 and int8 checkpoints of MODEL_DIR (`megadecode
#            quantize --quantize-lm-head`, group 128), as llama.cpp's types quantize its output too
#   speed    batch-1 decode: llama-bench tg against `megadecode bench` with int4 / int8 weights
#            (W4A16, W4A8, W8A16, W8A8) and bf16, ROUNDS interleaved rounds, each megadecode run
#            beside its read bandwidth probe
#   batched  aggregate tokens/s at B = 1, 4, 8: llama-batched-bench against megadecode bench
#            --batch 1,4,8 (int4 W4A8 and bf16)
#   kl       KL divergence and top-1 agreement against the bf16 model over the same text: llama.cpp's
#            llama-perplexity --kl-divergence for Q4_K_M and Q8_0, megadecode quant-eval --text for
#            int4 (group 128 with and without --act-quant int8, group 32) and int8 (with and
#            without --act-quant int8)
#
# Nothing of llama.cpp is committed: it is fetched and built under $WORK (default build/llamacpp).
# Output: $WORK/results/*.txt (one log per step and run); bench/RESULTS.md quotes them by hand.
# Environment: WORK, ROUNDS (3), THREADS (all CPUs), LLAMA_TOKENS / LLAMA_REPS (llama-bench -n / -r:
# 32 / 3), SCHEMES (the speed step's: "int4 int8 bf16"), KL_CTX (256), KL_CHUNKS (2), TEXT (the
# file whose tokens feed the KL runs; default docs/architecture.md).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36 # vendors llama.cpp 0c1e570, which has kimi-linear
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=${1:?usage: compare.sh MODEL_DIR [setup|convert|speed|batched|kl ...]}
shift
STEPS=${*:-setup convert speed batched kl}
WORK=${WORK:-$ROOT/build/llamacpp}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-$(nproc)}
KL_CTX=${KL_CTX:-256}
KL_CHUNKS=${KL_CHUNKS:-2}
TEXT=${TEXT:-$ROOT/docs/architecture.md}
MEGADECODE=$ROOT/build/megadecode
NAME=$(basename "$MODEL")
INT4_MODEL=${INT4_MODEL:-$WORK/ckpt/$NAME-int4}
INT8_MODEL=${INT8_MODEL:-$WORK/ckpt/$NAME-int8}
SRC=$WORK/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
BIN=$WORK/build/bin
GGUF=$WORK/gguf
OUT=$WORK/results
[[ -f $MODEL/config.json ]] || { echo "compare.sh: $MODEL has no config.json" >&2; exit 2; }
[[ -x $MEGADECODE ]] || { echo "compare.sh: build megadecode first (make build)" >&2; exit 2; }
mkdir -p "$WORK" "$GGUF" "$OUT"

step_setup() {
  if [[ ! -d $SRC ]]; then
    python3 -m pip download --no-deps --no-binary :all: -d "$WORK/src" \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    tar -xzf "$WORK/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$WORK/src"
  fi
  cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF >"$WORK/cmake.log"
  cmake --build "$WORK/build" -j"$(nproc)" --target llama-bench llama-batched-bench \
    llama-quantize llama-perplexity >"$WORK/build.log"
  if [[ ! -x $WORK/venv/bin/python ]]; then
    python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install -q torch numpy safetensors sentencepiece tiktoken \
      "transformers==4.57.6" "protobuf<5" -e "$SRC/gguf-py"
  fi
}

step_convert() {
  local bf16=$GGUF/$NAME-bf16.gguf
  [[ -f $bf16 ]] || "$WORK/venv/bin/python" "$ROOT/bench/llamacpp/hf_to_gguf.py" \
    --llama-dir "$SRC" --model "$MODEL" --out "$bf16" >"$OUT/$NAME-convert.log" 2>&1
  for q in Q4_K_M Q8_0; do
    [[ -f $GGUF/$NAME-$q.gguf ]] || "$BIN/llama-quantize" "$bf16" "$GGUF/$NAME-$q.gguf" "$q" \
      "$THREADS" >"$OUT/$NAME-quantize-$q.log" 2>&1
  done
  local scheme dir
  for scheme in int4 int8; do
    dir=$INT8_MODEL
    [[ $scheme == int4 ]] && dir=$INT4_MODEL
    [[ -f $dir/config.json ]] || "$MEGADECODE" quantize --model "$MODEL" --out "$dir" \
      --scheme "$scheme" --quantize-lm-head
  done
  ls -l "$GGUF"/"$NAME"-*.gguf
}

# One `megadecode bench` decode run at batch 1; its output names the floor and the probe.
megadecode_decode() { # label, checkpoint, extra flags...
  local label=$1 model=$2
  shift 2
  echo "== megadecode $label"
  "$MEGADECODE" bench --model "$model" --batch "${BATCH:-1}" --executor megakernel --steps 16 \
    --reps 3 --no-mmap --threads "$THREADS" "$@"
}

# The read bandwidth of the moment (megadecode's probe, all threads), printed before each
# llama.cpp run: this host class flips between two bandwidth regimes.
probe() {
  "$ROOT/build/bench/megadecode_bench_kernels" --benchmark_filter="BM_ReadBandwidth/thr:$THREADS/" \
    --benchmark_min_time=0.3 2>/dev/null | grep -o 'median_GBps=[0-9.]*' || echo "(no probe)"
}

llama_decode() { # quant
  echo "== llama.cpp $1 tg; read bandwidth $(probe)"
  "$BIN/llama-bench" -m "$GGUF/$NAME-$1.gguf" -p 0 -n "${LLAMA_TOKENS:-32}" -r "${LLAMA_REPS:-3}" \
    -t "$THREADS" -lm none -o md
}

step_speed() {
  local log
  log=$OUT/$NAME-speed-$(date +%Y%m%dT%H%M).txt
  {
    echo "# $(date -u) $(lscpu | grep 'Model name' | sed 's/  */ /g'); megadecode $(git -C "$ROOT" rev-parse --short HEAD)"
    "$WORK/venv/bin/python" "$ROOT/bench/llamacpp/gguf_bytes.py" --llama-dir "$SRC" \
      "$GGUF/$NAME"-{Q4_K_M,Q8_0,bf16}.gguf
    for round in $(seq "$ROUNDS"); do
      echo "### round $round"
      for scheme in ${SCHEMES:-int4 int8 bf16}; do
        case $scheme in
          int4)
            llama_decode Q4_K_M
            megadecode_decode int4-W4A16 "$INT4_MODEL"
            megadecode_decode int4-W4A8 "$INT4_MODEL" --act-quant int8
            ;;
          int8)
            llama_decode Q8_0
            megadecode_decode int8-W8A16 "$INT8_MODEL"
            megadecode_decode int8-W8A8 "$INT8_MODEL" --act-quant int8
            ;;
          bf16)
            llama_decode bf16
            megadecode_decode bf16 "$MODEL"
            ;;
          *) echo "compare.sh: unknown scheme '$scheme' in SCHEMES" >&2; exit 2 ;;
        esac
      done
    done
  } 2>&1 | tee "$log"
}

step_batched() {
  local log
  log=$OUT/$NAME-batched-$(date +%Y%m%dT%H%M).txt
  {
    echo "# $(date -u) $(lscpu | grep 'Model name' | sed 's/  */ /g'); megadecode $(git -C "$ROOT" rev-parse --short HEAD)"
    for q in Q4_K_M bf16; do
      echo "== llama.cpp $q batched; read bandwidth $(probe)"
      "$BIN/llama-batched-bench" -m "$GGUF/$NAME-$q.gguf" -t "$THREADS" -c 4096 -npp 16 -ntg 32 \
        -npl 1,4,8 -lm none
    done
    BATCH=1,4,8 megadecode_decode int4-W4A8-batched "$INT4_MODEL" --act-quant int8
    BATCH=1,4,8 megadecode_decode bf16-batched "$MODEL"
  } 2>&1 | tee "$log"
}

step_kl() {
  local log base=$WORK/$NAME-kl-base.bin
  log=$OUT/$NAME-kl-$(date +%Y%m%dT%H%M).txt
  local positions=$KL_CTX
  {
    echo "# $(date -u); text $TEXT; llama.cpp: -c $KL_CTX --chunks $KL_CHUNKS (scores the second half of each chunk); megadecode: --positions $positions"
    "$BIN/llama-perplexity" -m "$GGUF/$NAME-bf16.gguf" -f "$TEXT" -c "$KL_CTX" --chunks "$KL_CHUNKS" \
      -t "$THREADS" --kl-divergence-base "$base"
    for q in Q4_K_M Q8_0; do
      echo "== llama.cpp $q"
      "$BIN/llama-perplexity" -m "$GGUF/$NAME-$q.gguf" -f "$TEXT" -c "$KL_CTX" --chunks "$KL_CHUNKS" \
        -t "$THREADS" --kl-divergence-base "$base" --kl-divergence 2>&1 | sed -n '/KL divergence statistics/,$p'
    done
    for scheme in "int4" "int4 --act-quant int8" "int4 --quant-group 32" "int8" \
      "int8 --act-quant int8"; do
      echo "== megadecode $scheme"
      # shellcheck disable=SC2086
      "$MEGADECODE" quant-eval --model "$MODEL" --text "$TEXT" --positions "$positions" \
        --threads "$THREADS" --quantize $scheme --quantize-lm-head
    done
  } 2>&1 | tee "$log"
}

for step in $STEPS; do
  case $step in
    setup | convert | speed | batched | kl) "step_$step" ;;
    *) echo "compare.sh: unknown step '$step' (setup, convert, speed, batched, kl)" >&2; exit 2 ;;
  esac
done
