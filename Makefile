# The two commands: `make run` (default pipeline) and `make test` (test suite). Each sets up .venv.
CORES ?= 2
SNAKEMAKE_ARGS ?=

.PHONY: setup run test clean
setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS)

test: setup
	# One OpenBLAS thread: on a busy 2-core machine threaded QR/GEMM runs up to 30x slower.
	OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q -ra tests

clean:
	rm -rf results logs .snakemake
