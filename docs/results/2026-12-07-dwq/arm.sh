# bash arm.sh BITS ARM OUT [extra flags]: one bench-quality arm part against /tmp/dwq/ref
cd /work/main
b=$1 arm=$2 out=$3; shift 3
env $(.venv/bin/python -m vqpipe.blas --env) OPENBLAS_NUM_THREADS=2 /usr/bin/time -v .venv/bin/python -m vqpipe bench-quality \
  --source results/models/smollm2/source --reference /tmp/dwq/ref --model smollm2 --bits $b --arms $arm \
  --windows 20 --length 512 --texts devil jargon --embeddings "$@" --out $out
