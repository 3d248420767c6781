#!/bin/bash
# Interleaved A/B of the quantize stage command as the pipeline runs it at 2 threads (calibration on),
# old tree vs new tree, ROUNDS rounds (the order alternates), /usr/bin/time -v per run, then a summary.
#   OLD=/path/to/old/checkout NEW=/path/to/new/checkout SRC=/tmp/q11/source OUT=/tmp/q11/ab ROUNDS=3 \
#     bash docs/results/2026-12-03-q11/ab.sh
# SRC: python -m vqpipe download --source synth:qwen2.5-0.5b --seed 0 --dtype bfloat16 --out $SRC
set -e
P=${P:-/work/main/.venv/bin/python}
BLAS="$($P -m vqpipe.blas --env)"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p $OUT
stage() {  # tree label round
  rm -rf $OUT/q-$2-$3
  (cd $1 && env $BLAS OPENBLAS_NUM_THREADS=2 PYTHONUNBUFFERED=1 PYTHONPATH=$1 /usr/bin/time -v $P -m vqpipe quantize \
     --source $SRC --out $OUT/q-$2-$3 --bits 4 --group-size 64 --calibration text --calib-windows 2 --no-sequential --threads 2) \
     > $OUT/$2-$3.log 2>&1
}
for i in $(seq 1 ${ROUNDS:-3}); do
  echo "round $i $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/order.txt
  if [ $((i % 2)) = 1 ]; then stage $OLD old $i; stage $NEW new $i; else stage $NEW new $i; stage $OLD old $i; fi
done
echo "done $(date -u +%T)" >> $OUT/order.txt
$P $HERE/summary.py $OUT
