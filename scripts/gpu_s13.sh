#!/usr/bin/env bash
# Session 13's H200 job. PART=a: the decode step kernel by kernel under Nsight Compute
# (experiments/step_kernels.py; qwen2.5-0.5b affine4 / vqpipe-b4 / bf16 split steps, ARMS8 at the 8B
# preset), then KIVI v4 with __launch_bounds__ for 3 and 4 blocks per SM (bench-kivi-latency at 8k and
# 32k, v4's default shape alongside; ncu on the 3-block launch at 32k).
set -o pipefail
source scripts/gpu_env.sh
OUT=${OUT:-results/s13}
mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=/root/ptx
mkdir -p $MLX_PTX_CACHE_DIR
t0=$(date +%s)
since() { echo "($(( $(date +%s) - t0 )) s)"; }
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
kernels() {  # PRESET ARM LIMIT [step_kernels options]
  local tag=$1-${2//+/_}${4:+${4//[- ]/_}}
  echo "== step kernels $1 $2 ${4:-} $(since)"
  timeout $3 "$NCU" --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --print-kernel-base function --csv --log-file "$OUT/k-$tag.csv" \
    python3 -m experiments.step_kernels --preset $1 --arm $2 --steps ${STEPS:-3} ${4:-} > "$OUT/k-$tag.log" 2>&1
  tail -n 3 "$OUT/k-$tag.log"
  python3 -m experiments.step_kernels --summarize "$OUT/k-$tag.csv" --steps ${STEPS:-3} --out "$OUT/k-$tag.json" 2>&1 | head -n ${TOP:-25}
}
if [ "${PART:-a}" = a ]; then
  for arm in ${ARMS:-affine4+s vqpipe-b4+s bf16+s}; do kernels qwen2.5-0.5b $arm ${LK:-90}; done
  for arm in ${ARMS8:-vqpipe-b4+s}; do kernels llama3-8b $arm ${LK8:-150}; done
  echo "== kivi latency, launch bounds $(since)"
  timeout ${LAT_LIMIT:-170} python3 -m experiments.kivi_latency --out "$OUT/kivi_lat_mb.json" --contexts 8192,32768 \
    --shapes 4xf:v4,4xf:mb3:v4,4xf:mb4:v4 --repeats ${LREP:-15} --warmup 3 2>&1 | tee "$OUT/kivi_lat_mb.log" | tail -n 30
  echo "== ncu kivi v4 mb3 at 32k $(since)"
  VQPIPE_KIVI_V4_SHAPE=4xf:mb3 timeout 60 "$NCU" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats -k regex:"kivi_decode_attn" -c 2 \
    python3 -m experiments.kivi_floor --out "$OUT/floor_mb3.json" --contexts 32768 --layers 2 --repeats 1 --warmup 0 \
    --arms kivi4-v4-chain > "$OUT/ncu_kivi_mb3.log" 2>&1
  grep -E "kivi_decode_attn|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|No Eligible|Block Limit" "$OUT/ncu_kivi_mb3.log" | head -n 30
fi
# PART=b: the KV write (bench/kv_write.py: slice_update vs put_along_axis at 512 / 4k / 32k), the step
# kernels again with the new default write (qwen fused and unfused, 8B), Nsight's sections on qwen's
# mat-vec kernels (why the fused q|k|v and gate|up launches take 2-3x what bench-qmv timed)
if [ "${PART}" = b ]; then
  echo "== kv write $(since)"
  timeout ${LKV:-120} python3 -m experiments.kv_write --out "$OUT/kv_write.json" --capacities 512,4096,32768 2>&1 | tee "$OUT/kv_write.log"
  kernels qwen2.5-0.5b vqpipe-b4+s ${LK:-90}
  kernels qwen2.5-0.5b vqpipe-b4+s ${LK:-90} --nofuse
  kernels llama3-8b vqpipe-b4+s ${LK8:-150}
  echo "== ncu sections, qwen mat-vecs $(since)"
  timeout ${LKD:-90} "$NCU" --profile-from-start off --clock-control none --cache-control none -k regex:vqpipe_qmv -c 8 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
    python3 -m experiments.step_kernels --preset qwen2.5-0.5b --arm vqpipe-b4+s --steps 1 > "$OUT/ncu_qmv_qwen.log" 2>&1
  grep -E "custom_kernel_vqpipe|Duration|DRAM Throughput|L2 Hit Rate|L1/TEX Hit|Registers Per|Achieved Occupancy|Memory Throughput|Mem Busy|Max Bandwidth|Waves Per SM" "$OUT/ncu_qmv_qwen.log" | sed 's/(const.*)//' | head -n 120
fi
# PART=c: decode side by side, split step, P = 512: the new KV write (vqpipe-b4+s) against the old
# (vqpipe-b4+w+s), padded small arrays (vqpipe-b4+s) against pooled ones (vqpipe-b4+g+s), the
# residual-rotated layout (vqpipe-b4-res+s, session 14), with bf16+s and affine4+s, qwen then 8B
if [ "${PART}" = c ]; then
  for p in qwen2.5-0.5b llama3-8b; do
    timeout ${LE:-200} python3 -m experiments.decode_shapes --preset $p --out $OUT/write-$p.json \
      --prompt-lengths ${PL:-512} --gen-tokens 32 --repeats ${REPEATS:-6} --bits 4 --slice-writes-bits 4 --pooled-bits 4 --residual-bits 4 --split-only \
      --aa-arm vqpipe-b4+s --copy-mib 256 2>&1 | tee $OUT/write-$p.log | grep -E "^step|decode|floor|vs" | tail -30
  done
fi
# PART=t (session 14): the GPU side of the code sessions 13 and 14 added: the residual rotation's tests
# on the default (CUDA) device (the mat-vec kernels take its unrotated q|k|v and gate|up, the tied
# head's map), the padded small arrays, and the decode-step and qmv GPU tests
if [ "${PART}" = t ]; then
  timeout ${TEST_LIMIT:-400} python3 -m pytest -q -p no:cacheprovider -n 8 --dist load -rfE \
    tests/test_residual_rotation.py tests/test_small_arrays.py tests/test_step_kernels.py 2>&1 | tee $OUT/tests_res.log | tail -n 15
  timeout ${TEST_LIMIT:-400} python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --dist load -rfE \
    tests/test_decode_step.py tests/test_qmv.py tests/test_qmv_tc.py tests/test_fused_fold.py 2>&1 | tee $OUT/tests_gpu.log | tail -n 15
fi
(cd "$OUT" && tar czf ../s13-${PART:-a}.tgz . && rm -rf ./* && mv ../s13-${PART:-a}.tgz .)
echo "== done $(since)"
