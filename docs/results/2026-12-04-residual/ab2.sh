#!/usr/bin/env bash
# SmolLM2: residual rotation off vs on at several seeds and widths, as the default pipeline quantizes it
set -e
cd /work/main
source scripts/env.sh >/dev/null 2>&1
export OPENBLAS_NUM_THREADS=1
D=/tmp/kq/ab; PY=.venv/bin/python
LB=$($PY -c "import yaml,json; print(json.dumps(yaml.safe_load(open('config/config.yaml'))['models']['smollm2']['quantize']['layer_bits']))")
run() {  # SEED BITS
  s=$1; b=$2
  [ -d $D/mom-res-s$s ] || $PY -m vqpipe calibrate --source $D/src --out $D/mom-res-s$s --calib-windows 64 --calib-length 512 --residual-rotation auto --seed $s
  m=$D/mom-res-s$s
  [ -d $D/q$b-plain-s$s ] || $PY -m vqpipe quantize --source $D/src --out $D/q$b-plain-s$s --bits $b --seed $s --moments $D/mom-plain --layer-bits "$LB" --threads 2
  [ -d $D/q$b-res-s$s ] || $PY -m vqpipe quantize --source $D/src --out $D/q$b-res-s$s --bits $b --seed $s --moments $m --layer-bits "$LB" --residual-rotation --threads 2
  for v in plain res; do
    [ -f $D/bq$b-$v-s$s.json ] || $PY -m vqpipe bench-quality --source $D/src --reference $D/ref --bits $b --arms vqpipe --quantized $D/q$b-$v-s$s --windows 20 --length 512 --out $D/bq$b-$v-s$s.json 2>&1 | grep -E "bit vqpipe"
  done
}
run 1 4
run 0 3
run 0 2
run 2 4
echo AB2 DONE
