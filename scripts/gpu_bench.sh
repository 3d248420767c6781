#!/usr/bin/env bash
# The GPU benchmark job: the pipeline's stage commands for one model (default the synthetic
# qwen2.5-0.5b preset), run in order without snakemake (the offline GPU host has none), then
# the report. Same commands as workflow/rules/*.smk, with the benchmark settings of config/qwen.yaml.
#
#   bash scripts/gpu_bench.sh            # after staging the MLX CUDA runtime (docs/kivi.md)
#   STEPS="pipeline bench" bash scripts/gpu_bench.sh
#
# STEPS (default "pipeline quality load kivi decode report") picks steps; LOAD_LIMIT the seconds
# bench-load may take (default 300); QUALITY_TIMING and
# LOAD_ROTATIONS (default "auto qr") the rotations timed by bench-quality and bench-load; WORK holds the
# artifacts (default /root/vqwork, kept between calls on the same machine); results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
WORK=${WORK:-/root/vqwork}
MODEL=${MODEL:-qwen2.5-0.5b}
BITS=${BITS:-4}
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}

source scripts/gpu_env.sh

t0=$(date +%s)
since() { echo "[$(( $(date +%s) - t0 )) s]"; }
STEPS=${STEPS:-pipeline quality load kivi decode report}
want() { [[ " $STEPS " == *" $1 "* ]]; }
vq() {  # one stage, its log under $OUT/logs, never stops the job
  local name=$1 limit=$2
  shift 2
  mkdir -p "$OUT/logs"
  echo "== $name $(since)"
  timeout "$limit" $PY -m vqpipe "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  tail -n 4 "$OUT/logs/$name.log"
  echo "   $name: exit $rc $(since)"
}

SRC=$WORK/models/$MODEL/source
Q=$WORK/quantized/$MODEL/b$BITS-auto
gpu_record_env "$OUT/env.txt"

if want pipeline; then
  [ -f "$SRC/config.json" ] || vq download 120 download --source "synth:$MODEL" --out "$SRC"
  vq quantize 240 quantize --source "$SRC" --out "$Q" --bits "$BITS" --rotation auto
  for p in on off; do
    vq pack-$p 120 pack --quantized "$Q" --out "$WORK/reservoir/$MODEL/b$BITS-auto/persist-$p" --persist-rotation $p
    vq validate-$p 120 validate --reservoir "$WORK/reservoir/$MODEL/b$BITS-auto/persist-$p" --reference "$Q" \
      --out "$OUT/validate-$MODEL-b$BITS-auto-persist-$p.json" --model "$MODEL" --variant "b$BITS-auto" --persist-rotation $p
  done
fi
want quality && vq bench-quality 240 bench-quality --source "$SRC" --model "$MODEL" --bits 2 3 4 \
  --windows 20 --length 128 --timing ${QUALITY_TIMING:-auto qr} --timing-repeats 2 --out "$OUT/bench-quality-$MODEL.json"
want load && vq bench-load ${LOAD_LIMIT:-300} bench-load --source "$SRC" --model "$MODEL" --bits "$BITS" --rotations ${LOAD_ROTATIONS:-auto qr} \
  --repeats ${LOAD_REPEATS:-5} --arm-budget 60 --procs 4 --out "$OUT/bench-load-$MODEL.json"
want kivi && vq bench-kivi 180 bench-kivi --out "$OUT/bench-kivi.json"
want decode && vq bench-decode 300 bench-decode --source "$SRC" --reservoir "$WORK/reservoir/$MODEL/b$BITS-auto/persist-off" \
  --model "$MODEL" --prompt-lengths 512 4096 --gen-tokens 128 --repeats ${DECODE_REPEATS:-3} \
  --kivi-ops "$OUT/bench-kivi.json" --out "$OUT/bench-decode-$MODEL.json"
want report && vq report 120 report --inputs "$OUT" "$WORK/quantized" "$WORK/reservoir" --out "$OUT/report"
echo "== done $(since)"
ls -la "$OUT" "$OUT/report" 2>/dev/null
