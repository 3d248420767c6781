# The two commands: `make run` (default pipeline) and `make test` (test suite). Each sets up .venv.
CORES ?= 2
SNAKEMAKE_ARGS ?=
# The CPU BLAS is decided by the environment a process starts in (vqpipe/blas.py): the Snakefile
# sets it for its jobs; the tests get it here, so in-process and subprocess results agree.
BLAS_ENV = env $$(.venv/bin/python -m vqpipe.blas --env)

.PHONY: setup run test test-fast clean
setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS)

# One OpenBLAS thread for tests: on a busy 2-core machine threaded QR/GEMM runs up to 30x slower.
# TEST_WORKERS pytest-xdist workers, a whole file each (module fixtures are built once), in the
# order tests/conftest.py puts them (the longest first); TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
PYTEST = $(BLAS_ENV) OPENBLAS_NUM_THREADS=1 .venv/bin/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(PYTEST) tests

# The development loop: everything but the `slow` tests (real Snakemake runs, campaigns).
test-fast: setup
	$(PYTEST) -m "not slow" tests

clean:
	rm -rf results logs .snakemake
