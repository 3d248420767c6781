#!/usr/bin/env bash
# Session 10 (qmv9) H200 job: end-to-end decode with qmv revision 8 on, split-mode compiled step,
# with the step attribution (host vs GPU time per step, bench/step_attribution.py).
# PART=a: 8B P=512 + qwen P=512/4096 (default env), qwen profile under MLX_USE_CUDA_GRAPHS=0.
set -o pipefail
source scripts/gpu_env.sh
OUT=${OUT:-results/qmv9}
mkdir -p "$OUT"
gpu_record_env "$OUT/env.txt" > /dev/null
{ command -v nsys; ls /usr/local/cuda*/bin 2>/dev/null | grep -E "^(nsys|ncu)$"; } > "$OUT/profilers.txt" 2>&1
PART=${PART:-a}
B8=${B8:---bits 4 --prologue-bits 4}
if [ "$PART" = a ]; then
  timeout ${L8:-190} python3 -m experiments.decode_shapes --preset llama3-8b --out $OUT/8b-p512-split.json \
    --prompt-lengths 512 --gen-tokens 32 --repeats 5 $B8 --split --attribution --copy-mib 1024 2>&1 | tee $OUT/8b.log | grep -vE "^  P=" | tail -40
  timeout ${LQ:-80} python3 -m experiments.decode_shapes --preset qwen2.5-0.5b --out $OUT/qwen-split.json \
    --prompt-lengths 4096 512 --gen-tokens 32 --repeats 5 --bits 4 --prologue-bits 4 --split --attribution --copy-mib 1024 2>&1 | tee $OUT/qwen.log | grep -vE "^  P=" | tail -40
  MLX_USE_CUDA_GRAPHS=0 timeout ${LG:-40} python3 -m experiments.decode_shapes --preset qwen2.5-0.5b --out $OUT/qwen-nographs.json \
    --prompt-lengths 512 --bits 4 --split --attribution --profile-only --copy-mib 64 2>&1 | tee $OUT/qwen-nographs.log | grep attribution
fi
# PART=b: the split step's host/GPU attribution and interleaved decode under MLX_MAX_OPS_PER_BUFFER
# (kernels per CUDA graph, read once per process: one process per value, the PTX cache shared), 8B then qwen.
# On 2026-12-03 60 s (first 8B process, kernels compiled cold) and 38 s (second) were too short: give the
# first 8B process >= 90 s.
if [ "$PART" = b ]; then
  export MLX_PTX_CACHE_DIR=/root/ptx
  timeout 30 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_step_attribution.py 2>&1 | tail -2 | tee $OUT/gpu_tests.log
  for p in ${PRESETS:-llama3-8b qwen2.5-0.5b}; do
    for n in ${OPS:-250 20}; do
      MLX_MAX_OPS_PER_BUFFER=$n timeout ${LB:-90} python3 -m experiments.step_attribution --preset $p \
        --arms bf16 affine4 vqpipe-b4 --gpu-steps 2 --spin-ms 150 --rounds 5 --tokens 32 --out $OUT/attr-$p-ops$n.json 2>&1 | tee $OUT/attr-$p-ops$n.log | grep -E "tok/s| vs "
    done
  done
fi
