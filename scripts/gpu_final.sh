#!/usr/bin/env bash
# The coordinator's end-of-session H200 run (2026-12-01: docs/results/2026-12-01-h200-final/, session 8:
# docs/results/2026-12-01-h200-s8/): the GPU tests of the packed KIVI attention, the folded/fused decode
# paths, experiments/nvrtc.py and qmv, then prefill/decode at qwen
# P = 4096 (folded vs unfolded signs, new vs old dense rebuild) and the 8B split-mode decode.
# Run from the repository root on the GPU host after staging part00 (docs/kivi.md, "Running on a GPU").
# PART=tests or PART=bench runs one half (each fits one 600 s call).
set -o pipefail
[ -d /opt/mlx/mlx ] || { mkdir -p /opt/mlx && cat /root/stage/mlx-cuda13-site.tar.xz.part00 .gpu/mlx-cuda13-site.tar.xz.part01 | tar xJ -C /opt/mlx; }
export PYTHONPATH=/opt/mlx:$PWD PYTHONUNBUFFERED=1
PART=${PART:-bench}
if [ "$PART" = tests ]; then
  # every GPU-marked test in one xdist run (8 workers on the host's 16 cores share the GPU; the NVRTC
  # compiles are CPU-bound, which is what cut the serial runs of session 8 short)
  timeout ${TEST_LIMIT:-540} python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --dist load --durations 15 -v -rfE \
    tests/test_kivi_attention.py tests/test_kivi_kernels.py tests/test_fused_fold.py tests/test_fused.py \
    tests/test_decode_step.py tests/test_nvrtc.py tests/test_qmv.py tests/test_qmv_gpu_time.py tests/test_qmv_tc.py tests/test_qmv_epilogue.py tests/test_prep.py tests/test_kivi_compiled.py tests/test_step_attribution.py 2>&1 | tee $OUT/gpu_tests.log | grep -E 'FAILED|ERROR|Error|passed|failed|slowest|s call' | tail -80
  grep -q -E '[0-9]+ (passed|failed)' $OUT/gpu_tests.log || echo '== cut by TEST_LIMIT before the summary; failures so far:' && grep -E '(FAILED|ERROR) tests' $OUT/gpu_tests.log | sort -u
  exit 0
fi
timeout 130 python3 -m experiments.decode_shapes --preset qwen2.5-0.5b --out $OUT/qwen-p4096.json --prompt-lengths 4096 --gen-tokens 32 --repeats 5 --bits 4 --unpack-bits 4 --unfolded-bits 4 --copy-mib 1024 2>&1 | tee $OUT/qwen.log | tail -40
timeout 230 python3 -m experiments.decode_shapes --preset llama3-8b --out $OUT/8b-p512-split.json --prompt-lengths 512 --gen-tokens 32 --repeats 5 --bits 4 --split --copy-mib 1024 2>&1 | tee $OUT/8b.log | tail -40
