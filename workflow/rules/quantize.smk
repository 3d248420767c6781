# quantize: every Linear -> rotation + Lloyd-Max codebook; also records the reference logits
# (under the configured BLAS) that validate compares against.


def quantize_option(model, key):
    """Quantize option ``key`` of ``model``: models.NAME.quantize.KEY, else quantize.KEY."""
    return config["models"][model].get("quantize", {}).get(key, config["quantize"][key])


def quantize_flags(model):
    """Command-line flags of the options that change the codes (all of them are rule params)."""
    q = config["quantize"]
    emb = quantize_option(model, "embeddings")
    flags = (" --embeddings" if emb else " --no-embeddings") + ("" if q["lm_head"] else " --no-lm-head")
    group = quantize_option(model, "group_size")
    if group is not None:
        flags += f" --group-size {group}"
    cal = quantize_option(model, "calibration")
    if stored_moments(model):
        flags += f" --moments {MOMENTS.format(model=model)} --damp {cal['damp']}"
    elif cal["text"] != "none":
        flags += (f" --calibration {cal['text']} --calib-windows {cal['windows']} --calib-length {cal['length']}"
                  f" --calib-seed {cal['seed']} --damp {cal['damp']}")
    return flags


def stored_moments(model):
    """Whether ``model``'s quantize jobs read the calibrate stage's full-precision moments (one
    pass per model for every bit width and rotation) instead of calibrating sequentially."""
    cal = quantize_option(model, "calibration")
    return cal["text"] != "none" and not cal.get("sequential", True)


rule calibrate:
    input:
        source=SOURCE,
        code=stage_sources("vqpipe.moments"),
    output:
        directory(MOMENTS),
    params:
        software=SOFTWARE,
        calibration=lambda w: quantize_option(w.model, "calibration"),
        blas=BLAS,
        windows=lambda w: quantize_option(w.model, "calibration")["windows"],
        length=lambda w: quantize_option(w.model, "calibration")["length"],
        seed=lambda w: quantize_option(w.model, "calibration")["seed"],
    log:
        "logs/calibrate/{model}.log",
    threads: res("quantize", "threads")
    resources:
        mem_mb=res("quantize", "mem_mb"),
        runtime=res("quantize", "runtime"),
    cache: "omit-software"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "calibrate --source {input.source:q} --out {output:q} --calib-windows {params.windows}"
            " --calib-length {params.length} --calib-seed {params.seed}"
        )


rule quantize:
    input:
        source=SOURCE,
        # Not vqpipe.bench.env (imported lazily for the environment record in reference.json):
        # it does not change the artifact's numbers, and validate refuses a changed record.
        code=stage_sources("vqpipe.quantize"),
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
        calibration=lambda w: quantize_option(w.model, "calibration"),
        flags=lambda w: quantize_flags(w.model),
    log:
        "logs/quantize/{model}/b{bits}-{rotation}.log",
    threads: res("quantize", "threads")
    resources:
        mem_mb=res("quantize", "mem_mb"),
        runtime=res("quantize", "runtime"),
    cache: "omit-software"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "quantize --source {input.source:q} --out {output:q} --bits {params.bits}"
            " --rotation {params.rotation} --seed {params.seed} --dtype {params.dtype}{params.flags}"
        )
