# pack: a quantized artifact -> a reservoir (model.vqres), once per persist_rotation value.


rule pack:
    input:
        quantized=QUANTIZED,
        code=stage_sources("vqpipe.stages.pack", "vqpipe.store.reservoir"),
    output:
        directory(RESERVOIR),
    params:
        software=SOFTWARE,
        # The between-workflow cache key ignores wildcards: persist must be a param, or the
        # persist-on and persist-off reservoirs would share one cache entry.
        model="{model}",
        bits="{bits}",
        rotation="{rotation}",
        persist_rotation="{persist}",
    log:
        "logs/pack/{model}/b{bits}-{rotation}/persist-{persist}.log",
    priority: priority()
    cache: "omit-software"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "pack --quantized {input.quantized:q} --out {output:q} --persist-rotation {params.persist_rotation}"
        )
