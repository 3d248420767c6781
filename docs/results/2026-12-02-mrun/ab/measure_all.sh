#!/bin/bash
# Before/after per job: base = /tmp/mrun-base (ef361d7), new = the mrun worktree. Interleaved A B.
set -u
cd /tmp/mrun-w
export $(/work/main/.venv/bin/python -m vqpipe.blas --env) OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
PY=/work/main/.venv/bin/python
AB="$PY /tmp/mrun-scripts/ab.py"
B=base=/tmp/mrun-base; N=new=/work/main/.wt/mrun
O=/tmp/mrun-w/meas; mkdir -p $O
uptime > $O/uptime-start.txt
$AB 2 $O/arm-b4-vqpipe $B $N -- $PY -m vqpipe bench-quality --source results/models/smollm2/source --reference results/bench/smollm2/quality-reference --model smollm2 --bits 4 --arms vqpipe --rotation auto --affine-groups 32 64 128 --windows 20 --length 512 --seed 0 --quantized results/quantized/smollm2/b4-auto --embeddings --out $O/arm-b4-vqpipe/{arm}-{r}.json > $O/arm-b4-vqpipe.txt 2>&1
$AB 2 $O/quantize-b4-auto $B $N -- $PY -m vqpipe quantize --source results/models/smollm2/source --out $O/quantize-b4-auto/{arm}-{r} --bits 4 --rotation auto --seed 0 --dtype source --embeddings --layer-bits "$(cat /tmp/mrun-lb.json)" --moments results/calibration/smollm2 --damp 0.01 > $O/quantize-b4-auto.txt 2>&1
$AB 1 $O/bench-load $B $N -- $PY -m vqpipe bench-load --source results/models/tiny-llama/source --model tiny-llama --bits 4 --rotations auto --repeats 3 --arm-budget 60 --procs 2 --out $O/bench-load/{arm}-{r}.json > $O/bench-load.txt 2>&1
$AB 1 $O/arm-b4-affine-g64 $B $N -- $PY -m vqpipe bench-quality --source results/models/smollm2/source --reference results/bench/smollm2/quality-reference --model smollm2 --bits 4 --arms affine-g64 --rotation auto --affine-groups 32 64 128 --windows 20 --length 512 --seed 0 --quantized --embeddings --out $O/arm-b4-affine-g64/{arm}-{r}.json > $O/arm-b4-affine-g64.txt 2>&1
$AB 2 $O/calibrate-16 $B $N -- $PY -m vqpipe calibrate --source results/models/smollm2/source --out $O/calibrate-16/{arm}-{r} --calib-windows 16 --calib-length 512 --calib-seed 0 > $O/calibrate-16.txt 2>&1
$AB 1 $O/reference $B $N -- $PY -m vqpipe bench-quality --source results/models/smollm2/source --windows 20 --length 512 --gen-prompts 3 --gen-tokens 32 --reference-out $O/reference/{arm}-{r} > $O/reference.txt 2>&1
$AB 2 $O/validate-tiny $B $N -- $PY -m vqpipe validate --reservoir results/reservoir/tiny/b4-auto/persist-on --reference results/quantized/tiny/b4-auto --out $O/validate-tiny/{arm}-{r}.json --model tiny --variant b4-auto --persist-rotation on > $O/validate-tiny.txt 2>&1
$AB 2 $O/quantize-tiny $B $N -- $PY -m vqpipe quantize --source results/models/tiny/source --out $O/quantize-tiny/{arm}-{r} --bits 4 --rotation auto --seed 0 --dtype source --embeddings > $O/quantize-tiny.txt 2>&1
uptime > $O/uptime-end.txt
echo ALLDONE > $O/done
