#!/usr/bin/env bash
# The decode GPU job (issue 12): the qmv/fused GPU tests, bench-qmv (fused and Llama-3-8B shapes,
# 2/3/4 bits, M = 1 and 4), the qwen2.5-0.5b pipeline (quantize -> pack -> validate in both
# persist_rotation modes, quantized embedding and source dtypes by default), bench-decode
# (vqpipe 4-bit vs bf16 vs MLX affine 4-bit), and the 8B-shaped decode benchmark.
#
#   bash scripts/gpu_decode.sh                      # after staging the MLX CUDA runtime (docs/kivi.md)
#   STEPS="tests qmv" bash scripts/gpu_decode.sh
#
# STEPS (default "tests qmv pipeline decode"): tests, tests_rev4, tests_sweep, qmv, qmv_bits,
# pipeline, decode, load, big, shapes, tests_c, big_c, shapes_c, opsbuf, big_c4096, split (the _c steps: the
# compiled decode step, eager and compiled arms side by side) (tests_rev4 + tests_sweep = tests, in two time-limited parts:
# everything but the 252-configuration float64 sweep, then the sweep).
# TEST_K selects GPU tests (pytest -k), QMV_MODES/QMV_REPEATS/QMV_SHAPES/QMV_EXTRA bench-qmv,
# BIG_BITS/BIG_ROT_BITS the 8B arms (ROT: +rot arms, the rotation in the kernel's prologue),
# SHAPES_PRESET/SHAPES_BITS the in-memory decode benchmark of `shapes` (default qwen2.5-0.5b).
# WORK holds the artifacts (default /root/vqwork, kept between calls on one machine); results go
# to $OUT (default results/gpu_decode).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_decode}
WORK=${WORK:-/root/vqwork}
MODEL=${MODEL:-qwen2.5-0.5b}
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}

source scripts/gpu_env.sh
gpu_record_env "$OUT/env.txt"

t0=$(date +%s)
since() { echo "[$(( $(date +%s) - t0 )) s]"; }
STEPS=${STEPS:-tests qmv pipeline decode}
want() { [[ " $STEPS " == *" $1 "* ]]; }
run() {  # name limit cmd...: one step, its output in $OUT/NAME.log, never stops the job
  local name=$1 limit=$2
  shift 2
  echo "== $name $(since)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n ${TAIL:-6} "$OUT/$name.log"
  echo "   $name: exit $rc $(since)"
}

SRC=$WORK/models/$MODEL/source
Q=$WORK/quantized/$MODEL/b4-auto
RES=$WORK/reservoir/$MODEL/b4-auto

if want tests; then
  # TEST_K: a pytest -k expression (one argument, spaces allowed), e.g. "not matches_float64_reference or 4864"
  TAIL=15 run gpu_tests "${TEST_LIMIT:-200}" $PY -m pytest -q -ra -p no:cacheprovider --maxfail=5 -m gpu \
    tests/test_qmv.py tests/test_fused.py -k "${TEST_K:-gpu or not gpu}"
fi
GPU_TESTS="tests/test_qmv.py tests/test_fused.py tests/test_decode_shapes.py"
if want tests_rev4; then
  TAIL=15 run gpu_tests_rev4 "${TEST_LIMIT:-100}" $PY -m pytest -q -ra -p no:cacheprovider --maxfail=5 -m gpu \
    $GPU_TESTS -k "not matches_float64_reference"
fi
if want big; then
  TAIL=60 run bench_decode_8b "${BIG_LIMIT:-300}" $PY -m experiments.decode_shapes --preset llama3-8b \
    --prompt-lengths 512 4096 --gen-tokens 128 --repeats ${BIG_REPEATS:-5} --bits ${BIG_BITS:-4 3 2} \
    --prologue-bits ${BIG_ROT_BITS:-4} --out "$OUT/bench-decode-llama3-8b.json"
fi
if want shapes; then
  P=${SHAPES_PRESET:-qwen2.5-0.5b}
  TAIL=60 run bench_decode_shapes_$P "${SHAPES_LIMIT:-120}" $PY -m experiments.decode_shapes --preset $P \
    --prompt-lengths ${SHAPES_LENGTHS:-512 4096} --gen-tokens ${SHAPES_GEN:-128} --repeats ${SHAPES_REPEATS:-5} \
    --bits ${SHAPES_BITS:-4 2} --prologue-bits 4 --copy-mib ${SHAPES_COPY_MIB:-1024} --out "$OUT/bench-decode-$P.json"
fi
# The compiled decode step (vqpipe/decode_step.py): its GPU tests, then eager vs compiled arms side
# by side at 8B (P = 512, then 4096 with fewer arms) and at qwen2.5-0.5b, and step profiles under
# other MLX_MAX_OPS_PER_BUFFER values (kernels per CUDA graph; MLX's default is 20).
if want tests_c; then
  TAIL=15 run gpu_tests_compiled "${TEST_LIMIT:-120}" $PY -m pytest -q -ra -p no:cacheprovider --maxfail=5 -m gpu \
    tests/test_decode_step.py
fi
if want big_c; then
  TAIL=80 run bench_decode_8b_compiled "${BIG_LIMIT:-200}" $PY -m experiments.decode_shapes --preset llama3-8b \
    --prompt-lengths 512 --gen-tokens 128 --repeats ${BIG_REPEATS:-5} --bits ${BIG_BITS:-4 3 2} --compiled \
    --prologue-bits ${BIG_ROT_BITS:-} --out "$OUT/bench-decode-llama3-8b-compiled.json"
fi
if want shapes_c; then
  TAIL=80 run bench_decode_qwen_compiled "${SHAPES_LIMIT:-150}" $PY -m experiments.decode_shapes --preset qwen2.5-0.5b \
    --prompt-lengths 512 4096 --gen-tokens 128 --repeats ${SHAPES_REPEATS:-5} --bits ${SHAPES_BITS:-4 2} --compiled \
    --prologue-bits 4 --out "$OUT/bench-decode-qwen2.5-0.5b-compiled.json"
fi
if want opsbuf; then
  for n in ${OPSBUF:-100 500}; do
    TAIL=14 MLX_MAX_OPS_PER_BUFFER=$n run profile_qwen_opsbuf$n 60 $PY -m experiments.decode_shapes --preset qwen2.5-0.5b \
      --profile-only --bits 4 --compiled --prologue-bits 4 --copy-mib 64 --out "$OUT/profile-qwen-opsbuf$n.json"
  done
fi
if want split; then  # decode_step's split mode: qwen timed at P = 512, the 8B step profiles
  TAIL=40 run bench_decode_qwen_split "${SPLIT_LIMIT:-75}" $PY -m experiments.decode_shapes --preset qwen2.5-0.5b \
    --prompt-lengths 512 --gen-tokens 128 --repeats 5 --bits 4 --prologue-bits 4 --split --copy-mib 256 \
    --out "$OUT/bench-decode-qwen2.5-0.5b-split.json"
  TAIL=20 run profile_8b_split "${SPLIT8B_LIMIT:-50}" $PY -m experiments.decode_shapes --preset llama3-8b \
    --profile-only --bits 4 --split --compiled --copy-mib 256 --out "$OUT/profile-llama3-8b-split.json"
fi
if want big_c4096; then
  TAIL=40 run bench_decode_8b_compiled_4096 "${BIG4096_LIMIT:-150}" $PY -m experiments.decode_shapes --preset llama3-8b \
    --prompt-lengths 4096 --gen-tokens 128 --repeats 5 --bits 4 --compiled --out "$OUT/bench-decode-llama3-8b-compiled-4096.json"
fi
if want qmv; then
  run bench_qmv "${QMV_LIMIT:-150}" $PY -m experiments.bench_qmv --modes ${QMV_MODES:-independent chained} \
    --repeats ${QMV_REPEATS:-20} --shapes ${QMV_SHAPES:-qwen-qkv qwen-q/o qwen-gateup qwen-down qwen-lm_head l3-qkv l3-o l3-gateup l3-down l3-lm_head} \
    ${QMV_EXTRA:-} --out "$OUT/bench-qmv.json"
fi
if want tests_sweep; then
  TAIL=15 run gpu_tests_sweep "${SWEEP_LIMIT:-100}" $PY -m pytest -q -ra -p no:cacheprovider --maxfail=5 -m gpu \
    tests/test_qmv.py -k "matches_float64_reference"
fi
if want qmv_bits; then
  for b in 2 3; do
    run bench_qmv_b$b 60 $PY -m experiments.bench_qmv --bits $b --modes independent --repeats 20 \
      --shapes l3-gateup l3-down l3-lm_head qwen-lm_head --out "$OUT/bench-qmv-b$b.json"
  done
  run bench_qmv_m4 60 $PY -m experiments.bench_qmv --m 4 --modes independent --repeats 20 \
    --shapes l3-gateup l3-down l3-lm_head --out "$OUT/bench-qmv-m4.json"
fi
if want pipeline; then
  [ -f "$SRC/config.json" ] || run download 120 $PY -m vqpipe download --source "synth:$MODEL" --out "$SRC"
  run quantize 240 $PY -m vqpipe quantize --source "$SRC" --out "$Q" --bits 4 --rotation auto
  for p in on off; do
    run pack_$p 120 $PY -m vqpipe pack --quantized "$Q" --out "$RES/persist-$p" --persist-rotation $p
    run validate_$p 120 $PY -m vqpipe validate --reservoir "$RES/persist-$p" --reference "$Q" \
      --out "$OUT/validate-$MODEL-b4-auto-persist-$p.json" --model "$MODEL" --variant b4-auto --persist-rotation $p
  done
  du -sh "$Q" "$RES"/persist-* | tee "$OUT/sizes.txt"
fi
if want decode; then
  TAIL=40 run bench_decode "${DECODE_LIMIT:-300}" $PY -m vqpipe bench-decode --source "$SRC" --reservoir "$RES/persist-off" \
    --model "$MODEL" --weights full vqpipe affine4 --caches fp --prompt-lengths 512 4096 --gen-tokens 128 \
    --repeats ${DECODE_REPEATS:-5} --out "$OUT/bench-decode-$MODEL.json"
fi
if want load; then
  run bench_load 200 $PY -m vqpipe bench-load --source "$SRC" --model "$MODEL" --bits 4 --rotations auto \
    --repeats 3 --arm-budget 40 --procs 2 --out "$OUT/bench-load-$MODEL.json"
fi
echo "== done $(since)"
ls -la "$OUT"
