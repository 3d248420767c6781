# quantize: every Linear -> rotation + Lloyd-Max codebook; also records the reference logits
# (under the configured BLAS) that validate compares against.


rule quantize:
    input:
        source=SOURCE,
        # Not vqpipe.bench.env (imported lazily for the environment record in reference.json):
        # it does not change the artifact's numbers, and validate refuses a changed record.
        code=stage_sources("vqpipe.stages.quantize"),
        moments=lambda w: [MOMENTS.format(model=w.model)] if stored_moments(w.model) else [],
    output:
        directory(QUANTIZED),
    params:
        software=SOFTWARE,
        model="{model}",
        bits="{bits}",
        rotation="{rotation}",
        seed=config["quantize"]["seed"],
        embeddings=lambda w: quantize_option(w.model, "embeddings"),
        lm_head=config["quantize"]["lm_head"],
        dtype=config["quantize"]["dtype"],
        blas=BLAS,
        group_size=lambda w: quantize_option(w.model, "group_size"),
        layer_bits=lambda w: quantize_option(w.model, "layer_bits"),
        calibration=lambda w: quantize_option(w.model, "calibration"),
        budget=lambda w: quantize_option(w.model, "budget"),
        tune=lambda w: quantize_option(w.model, "tune"),
        flags=lambda w: quantize_flags(w.model, w.rotation, w.bits),
    log:
        "logs/quantize/{model}/b{bits}-{rotation}.log",
    priority: priority(1)
    cache: "omit-software"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "quantize --source {input.source:q} --out {output:q} --bits {params.bits}"
            " --rotation {params.rotation} --seed {params.seed} --dtype {params.dtype}{params.flags}"
            # the job's cores for GPTQ's numpy work (vqpipe/parallel.py): the bytes do not depend on it
            " --threads {threads}"
        )
