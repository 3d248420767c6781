# vqpipe: staged, cached build artifacts for quantized LLMs on MLX.
#
#   download -> quantize -> pack (persist-on / persist-off) -> validate -> benchmark -> report
#
# Run `make run` (or `.venv/bin/snakemake --cores 2`). Another config: `--configfile config/qwen.yaml`.
# Everything about caching, sharing artifacts and clusters is in docs/workflow.md.

from snakemake.utils import min_version, validate

min_version("9.0")


# The default config, unless --configfile names another: a config file given on the command line
# is complete on its own (Snakemake would otherwise merge it into this one, key by key).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# Fails here, before the DAG is built, with the offending key in the message.
validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/pack.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        all_targets(),
    default_target: True
