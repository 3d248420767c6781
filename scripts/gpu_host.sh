#!/usr/bin/env bash
# Session 12 coordinator's H200 job. PART=a: host time per primitive by kind (vqpipe/bench/host_cost.py)
# under MLX_MAX_OPS_PER_BUFFER 20 and 250, then KIVI end to end with the v4 default (gpu_kivi7.sh PART=b,
# no Nsight). PART=b: the 8B split bench under MLX_MAX_OPS_PER_BUFFER=250 (gpu_prep.sh PART=b).
set -o pipefail
source scripts/gpu_env.sh
OUT=${OUT:-results/host}
mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=/root/ptx
if [ "${PART:-a}" = a ]; then
  for n in 20 250 20 250; do
    MLX_MAX_OPS_PER_BUFFER=$n timeout 60 python3 -m vqpipe.bench.host_cost --out $OUT/host-ops$n.json 2>&1 | sed "s/^/ops$n /" | tee -a $OUT/host.log
  done
  OUT=$OUT/kivi NCU_CONTEXTS=" " DEC_LIMIT=${DEC_LIMIT:-200} PART=b bash scripts/gpu_kivi7.sh 2>&1 | tail -40
fi
if [ "${PART}" = b ]; then
  OUT=$OUT/ops250 PART=b L8=${L8:-230} bash scripts/gpu_prep.sh 2>&1 | tail -40
fi
