# quantize: every Linear -> rotation + Lloyd-Max codebook; also records the reference logits
# (under the configured BLAS) that validate compares against.


rule quantize:
    input:
        source=SOURCE,
        # Not vqpipe.bench.env (imported lazily for the environment record in reference.json):
        # it does not change the artifact's numbers, and validate refuses a changed record.
        code=stage_sources("vqpipe.quantize"),
    output:
        directory(QUANTIZED),
    params:
        model="{model}",
        bits="{bits}",
        rotation="{rotation}",
        seed=config["quantize"]["seed"],
        embeddings=config["quantize"]["embeddings"],
        lm_head=config["quantize"]["lm_head"],
        dtype=config["quantize"]["dtype"],
        blas=BLAS,
        flags=(" --embeddings" if config["quantize"]["embeddings"] else " --no-embeddings")
        + ("" if config["quantize"]["lm_head"] else " --no-lm-head"),
    log:
        "logs/quantize/{model}/b{bits}-{rotation}.log",
    threads: res("quantize", "threads")
    resources:
        mem_mb=res("quantize", "mem_mb"),
        runtime=res("quantize", "runtime"),
    cache: "omit-software"
    shell:
        vqpipe_cmd(
            "quantize --source {input.source:q} --out {output:q} --bits {params.bits}"
            " --rotation {params.rotation} --seed {params.seed} --dtype {params.dtype}{params.flags}"
        )
