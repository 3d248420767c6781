# validate: load each reservoir in a fresh process and compare its logits with quantize's
# reference byte for byte. Exits non-zero (the job fails, its verdict is removed) when the round
# trip is not bit-exact or the setups differ, so nothing downstream is built from a bad artifact.
# Not cached: the point is to check the artifact on this machine.


rule validate:
    input:
        reservoir=RESERVOIR,
        reference=QUANTIZED,
        code=stage_sources("vqpipe.stages.validate", "vqpipe.store.reservoir", "vqpipe.stages.quantize", "vqpipe.bench.env", "vqpipe.kivi.kernels"),
    output:
        report(
            VERDICT,
            caption="../report/validate.rst",
            category="Validation",
            subcategory="{model}",
            labels={"model": "{model}", "variant": "b{bits}-{rotation}", "persist_rotation": "{persist}"},
        ),
    params:
        model="{model}",
        variant="b{bits}-{rotation}",
        persist_rotation="{persist}",
        blas=BLAS,
    log:
        "logs/validate/{model}/b{bits}-{rotation}/persist-{persist}.log",
    priority: priority()
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "validate --reservoir {input.reservoir:q} --reference {input.reference:q} --out {output:q}"
            " --model {params.model} --variant {params.variant} --persist-rotation {params.persist_rotation}"
        )
