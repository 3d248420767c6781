"""The pipeline's stages: one module per Snakemake rule, each with ``main(argv)``
(``vqpipe STAGE``). The library they call lives in ``vqpipe/``."""
