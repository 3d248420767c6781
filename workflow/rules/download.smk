# download: a source model in Hugging Face layout (synth:PRESET is generated offline).


rule download:
    input:
        code=stage_sources("vqpipe.download", "vqpipe.synth", data=["corpus.txt"]),
    output:
        directory(SOURCE),
    params:
        software=SOFTWARE,
        model="{model}",
        source=lambda wc: config["models"][wc.model]["source"],
        seed=lambda wc: config["models"][wc.model]["seed"],
    log:
        "logs/download/{model}.log",
    threads: res("download", "threads")
    resources:
        mem_mb=res("download", "mem_mb"),
        runtime=res("download", "runtime"),
    cache: "omit-software"
    conda:
        ENV
    shell:
        vqpipe_cmd("download --source {params.source:q} --out {output:q} --seed {params.seed}")
