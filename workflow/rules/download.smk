# download: a source model in Hugging Face layout (synth:PRESET is generated offline).


rule download:
    input:
        model=source_files,
        code=stage_sources("vqpipe.stages.download", "vqpipe.sources.synth", "vqpipe.sources.gguf", "vqpipe.sources.gguf_tokenizer", data=["corpus.txt"]),
    output:
        directory(SOURCE),
    params:
        software=SOFTWARE,
        model="{model}",
        source=lambda wc: config["models"][wc.model]["source"],
        seed=lambda wc: config["models"][wc.model]["seed"],
        dtype=lambda wc: config["models"][wc.model]["dtype"],
    log:
        "logs/download/{model}.log",
    priority: priority(0)
    cache: "omit-software"
    conda:
        ENV
    shell:
        vqpipe_cmd("download --source {params.source:q} --out {output:q} --seed {params.seed} --dtype {params.dtype}")
