# calibrate: each linear's input second moments H = X^T X from the full-precision model on the
# calibration text, once per model; every quantize job of that model (all bits, all rotations)
# reads them when calibration.sequential is false (docs/gptq.md).


rule calibrate:
    input:
        source=SOURCE,
        code=stage_sources("vqpipe.stages.calibrate"),
    output:
        directory(MOMENTS),
    params:
        software=SOFTWARE,
        calibration=lambda w: quantize_option(w.model, "calibration"),
        blas=BLAS,
        windows=lambda w: quantize_option(w.model, "calibration")["windows"],
        length=lambda w: quantize_option(w.model, "calibration")["length"],
        seed=lambda w: quantize_option(w.model, "calibration")["seed"],
        # the residual rotation quantize folds in (its kind and seed): moments in its stream basis
        residual=lambda w: calibrate_flags(w.model),
    log:
        "logs/calibrate/{model}.log",
    priority: priority(0)
    cache: "omit-software"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "calibrate --source {input.source:q} --out {output:q} --calibration {params.calibration[text]}"
            " --calib-windows {params.windows}"
            " --calib-length {params.length} --calib-seed {params.seed}{params.residual}"
        )
