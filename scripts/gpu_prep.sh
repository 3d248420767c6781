#!/usr/bin/env bash
# Session 11 (helper prep) H200 job: the fused prep kernels (vqpipe/prep.py) and the residual epilogue.
# PART=a: the GPU tests of tests/test_prep.py and tests/test_qmv_epilogue.py, then the 8B P=512 split step
#   with arms vqpipe-b4+s, +e+s (epilogue), +p+s (prep), +pe+s (prep + epilogue), bf16+s and affine4+s,
#   interleaved, A/A floor from vqpipe-b4+s run twice, step attribution per arm.
# PART=bench: the bench alone (for a rerun once the tests passed).
# PART=b: the same bench under MLX_MAX_OPS_PER_BUFFER=$OPS (default 250; kernels per CUDA graph).
# Run from the repository root on the GPU host after staging part00 (scripts/gpu_env.sh).
set -o pipefail
source scripts/gpu_env.sh
OUT=${OUT:-results/prep}
mkdir -p "$OUT"
gpu_record_env "$OUT/env.txt" > /dev/null
export MLX_PTX_CACHE_DIR=/root/ptx
PART=${PART:-a}
bench() {  # $1: output prefix
  timeout ${L8:-230} python3 -m experiments.decode_shapes --preset llama3-8b --out $OUT/$1.json \
    --prompt-lengths 512 --gen-tokens 32 --repeats ${REPEATS:-8} --bits 4 --epilogue-bits 4 --prep-bits 4 \
    --split-only --aa-arm vqpipe-b4+s --attribution --copy-mib 1024 2>&1 | tee $OUT/$1.log | grep -vE "^  P=.*prefill" | tail -60
}
if [ "$PART" = a ]; then
  timeout ${TEST_LIMIT:-120} python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --dist load -v -rfE \
    tests/test_prep.py tests/test_qmv_epilogue.py 2>&1 | tee $OUT/gpu_tests.log | grep -E 'FAILED|ERROR|Error|passed|failed|error .*x the bound' | tail -40
  bench 8b-p512-split
fi
if [ "$PART" = bench ]; then
  bench 8b-p512-split
fi
if [ "$PART" = b ]; then
  MLX_MAX_OPS_PER_BUFFER=${OPS:-250} bench 8b-p512-split-ops${OPS:-250}
fi
