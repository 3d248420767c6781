#!/usr/bin/env bash
# qmv revision 8 (vqpipe/qmv_tc.py, the tensor-core mat-vec) on the H200: the GPU-time matrix against
# revision 6 (experiments/qmv_gpu_time.py: CUDA events outside MLX, copy and plain-read arms, a float64
# check per variant), an Nsight Compute profile of one launch per case (bank conflicts, pipes), the GPU
# tests (pytest -m gpu, 8 xdist workers; "tc1": the layer tests again with VQPIPE_QMV_TC=1). STEPS picks
# steps (default "time profile tests"; "final": the
# default configuration against revision 6 at M = 1, 2, 4, 8, then the ablations); VARIANTS, CASES,
# PROFILE_CASES, TESTS override. Results under $OUT. docs/qmv.md "Revision 8".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_qmv8}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
source scripts/gpu_env.sh
STEPS=${STEPS:-time profile tests}
want() { [[ " $STEPS " == *" $1 "* ]]; }
t0=$(date +%s)
since() { echo "($(( $(date +%s) - t0 )) s)"; }
SHAPES="l3-o l3-qkv l3-gateup l3-down l3-lm_head qwen-qkv qwen-gateup qwen-down qwen-lm_head"
ALL=""
for m in ${MS:-1 4 8}; do for s in $SHAPES; do ALL="$ALL $s:4:$m"; done; done

if want time; then
  echo "== GPU time $(since)"
  timeout "${TIME_LIMIT:-300}" $PY -m experiments.qmv_gpu_time --out "$OUT/gpu-time.json" \
    --variants ${VARIANTS:-qmv:auto:0 qmv_tc:0:0:0:1 qmv_tc:0:0:0:2 qmv_tc:0:0:3:2 qmv_tc:396:0:0:1} --cases ${CASES:-$ALL} ${TIME_ARGS:-} 2>&1 | tee "$OUT/gpu-time.log"
fi

if want final; then
  echo "== GPU time, default configuration $(since)"
  ALL=""; for m in 1 2 4 8; do for s in $SHAPES; do ALL="$ALL $s:4:$m"; done; done
  timeout "${TIME_LIMIT:-120}" $PY -m experiments.qmv_gpu_time --out "$OUT/gpu-time-final.json" \
    --variants qmv:auto:0 qmv_tc --cases $ALL 2>&1 | tee "$OUT/gpu-time-final.log"
  echo "== GPU time, ablations $(since)"
  timeout "${ABL_LIMIT:-60}" $PY -m experiments.qmv_gpu_time --out "$OUT/gpu-time-abl.json" \
    --variants qmv_tc qmv_tc:0:0:0:0:tcnolut qmv_tc:0:0:0:0:tcnoload qmv_tc:0:0:0:0:tcnolut+tcnoload qmv_tc:264:0:0:2 \
    --cases l3-gateup:4:1 l3-lm_head:4:1 qwen-lm_head:4:1 l3-gateup:4:8 l3-lm_head:4:8 2>&1 | tee "$OUT/gpu-time-abl.log"
fi

if want profile; then
  echo "== profile $(since)"
  gpu_ncu_profile "$OUT/profile" "${PROFILE_LIMIT:-120}" \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts.sum \
    $PY -m experiments.qmv_gpu_time --check-only --inputs 1 --max-pool 2 --out "$OUT/profile-check.json" \
    --variants ${PROFILE_VARIANTS:-qmv_tc:0:0:0:1 qmv_tc:0:0:0:2} \
    --cases ${PROFILE_CASES:-l3-gateup:4:1 l3-lm_head:4:1 l3-gateup:4:8}
  rm -f "$OUT/profile.ncu-rep"
fi

if want tests; then
  echo "== GPU tests $(since)"
  timeout "${TEST_LIMIT:-200}" $PY -m pytest -q -p no:cacheprovider -m gpu -n 8 --dist load \
    ${TESTS:-tests/test_qmv_tc.py tests/test_qmv.py tests/test_fused.py} 2>&1 | tail -n 25 | tee "$OUT/gpu-tests.log"
  want tc1 || { echo "== done $(since)"; exit 0; }
  # the layers' GPU tests again with revision 8 taking every call it can (bf16, 4 bits)
  echo "== GPU tests, VQPIPE_QMV_TC=1 $(since)"
  VQPIPE_QMV_TC=1 timeout "${TEST_LIMIT:-200}" $PY -m pytest -q -p no:cacheprovider -m gpu -n 8 --dist load \
    ${TC_TESTS:-tests/test_fused.py tests/test_qmv.py -k "generation or layer or embedding or fused or bias"} 2>&1 | tail -n 25 \
    | tee "$OUT/gpu-tests-tc1.log"
fi
echo "== done $(since)"
