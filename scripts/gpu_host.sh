#!/usr/bin/env bash
# Session 12 coordinator's H200 job. PART=a: host time per primitive by kind (experiments/host_cost.py)
# under MLX_MAX_OPS_PER_BUFFER 20 and 250, then KIVI end to end with the v4 default (gpu_kivi7.sh PART=b,
# no Nsight). PART=b: the 8B split bench under MLX_MAX_OPS_PER_BUFFER=250 (gpu_prep.sh PART=b).
set -o pipefail
source scripts/gpu_env.sh
OUT=${OUT:-results/host}
mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=/root/ptx
if [ "${PART:-a}" = a ]; then
  for n in 20 250 20 250; do
    MLX_MAX_OPS_PER_BUFFER=$n timeout 60 python3 -m experiments.host_cost --out $OUT/host-ops$n.json 2>&1 | sed "s/^/ops$n /" | tee -a $OUT/host.log
  done
  OUT=$OUT/kivi NCU_CONTEXTS=" " DEC_LIMIT=${DEC_LIMIT:-200} PART=b bash scripts/gpu_kivi7.sh 2>&1 | tail -40
fi
if [ "${PART}" = b ]; then
  OUT=$OUT/ops250 PART=b L8=${L8:-230} bash scripts/gpu_prep.sh 2>&1 | tail -40
fi
# PART=c: the GPU tests of what session 12 touched (host_cost, the split step), then the 8B split bench.
if [ "${PART}" = c ]; then
  timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --dist load -v -rfE \
    tests/test_host_cost.py tests/test_decode_step.py tests/test_prep.py tests/test_qmv_epilogue.py 2>&1 | tee $OUT/gpu_tests.log | grep -E 'FAILED|ERROR|passed|failed' | tail -20
  OUT=$OUT/lean PART=bench L8=${L8:-230} bash scripts/gpu_prep.sh 2>&1 | grep -E "^step|attribution|decode " | tail -40
fi
# PART=d: qwen2.5-0.5b split step at P=512 (the host-bound preset), then the 8B bench under 250 ops per graph.
if [ "${PART}" = d ]; then
  timeout ${LQ:-90} python3 -m experiments.decode_shapes --preset qwen2.5-0.5b --out $OUT/qwen-split.json \
    --prompt-lengths 512 --gen-tokens 32 --repeats 6 --bits 4 --epilogue-bits 4 --prep-bits 4 --split-only \
    --aa-arm vqpipe-b4+s --attribution --copy-mib 256 2>&1 | tee $OUT/qwen.log | grep -E "^step|attribution|decode " | tail -40
  OUT=$OUT/ops250 PART=b L8=${L8:-230} bash scripts/gpu_prep.sh 2>&1 | grep -E "^step|attribution|decode " | tail -40
fi
# PART=e: the view layouts side by side (vqpipe-b4+s lean vs vqpipe-b4+v+s mlx-lm's), qwen then 8B.
if [ "${PART}" = e ]; then
  for p in qwen2.5-0.5b llama3-8b; do
    timeout ${LE:-170} python3 -m experiments.decode_shapes --preset $p --out $OUT/views-$p.json \
      --prompt-lengths 512 --gen-tokens 32 --repeats ${REPEATS:-8} --bits 4 --mlx-views-bits 4 --split-only \
      --aa-arm vqpipe-b4+s --attribution --copy-mib 256 2>&1 | tee $OUT/views-$p.log | grep -E "^step|attribution|decode" | tail -30
  done
fi
