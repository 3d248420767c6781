#!/bin/bash
# Interleaved A/B of the qwen2.5-0.5b calibrated quantize stage command, old tree vs new tree,
# run as the quantize rule runs it at 2 threads, through scripts/stage_time.py (the stage in-process,
# timers per step) under /usr/bin/time -v. Order alternates A B / B A per round.
# OLD, NEW: trees; SRC: the source; OUT: where logs go; ROUNDS; P: python.
set -u
P=${P:-/work/main/.venv/bin/python}
ROUNDS=${ROUNDS:-4}
ST=$NEW/scripts/stage_time.py   # the new tree's timer (faults per step); it imports vqpipe from PYTHONPATH
BLAS="$($P -m vqpipe.blas --env)"
mkdir -p $OUT
one() {  # tree label round
  rm -rf $OUT/q-$2-$3
  echo "$2 $3 start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/order.txt
  (cd $1 && env $BLAS OPENBLAS_NUM_THREADS=2 PYTHONUNBUFFERED=1 PYTHONPATH=$1 /usr/bin/time -v $P $ST quantize \
     --source $SRC --out $OUT/q-$2-$3 --bits 4 --group-size 64 --calibration text --calib-windows 2 \
     --no-sequential --threads 2) > $OUT/$2-$3.log 2>&1
  echo "$2 $3 digest $($P $NEW/docs/results/2026-12-03-q11/digest.py $OUT/q-$2-$3) reference $(sha256sum $OUT/q-$2-$3/reference.safetensors | cut -c1-16)" >> $OUT/order.txt
  rm -rf $OUT/q-$2-$3
}
for i in $(seq 1 $ROUNDS); do
  if [ $((i % 2)) = 1 ]; then one $OLD old $i; one $NEW new $i; else one $NEW new $i; one $OLD old $i; fi
done
echo "done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/order.txt
