# The two commands: `make run` (default pipeline) and `make test` (test suite). Each sets up .venv.
CORES ?= 2
SNAKEMAKE_ARGS ?=

.PHONY: setup run test clean
setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS)

# One OpenBLAS thread for tests: on a busy 2-core machine threaded QR/GEMM runs up to 30x slower.
test: setup
	OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q -ra tests

clean:
	rm -rf results logs .snakemake
