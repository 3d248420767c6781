"""The pipeline's stages: one module per Snakemake rule, each with ``main(argv)``
(``python -m vqpipe STAGE``). The library they call lives in ``vqpipe/``."""
