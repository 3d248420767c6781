# download: a source model in Hugging Face layout (synth:PRESET is generated offline).


def source_files(wc):
    """A gguf: source's file, as an input: a changed file reruns download (and keys its cache)."""
    source = config["models"][wc.model]["source"]
    if not source.startswith("gguf:"):
        return []
    from vqpipe.gguf import resolve  # no mlx import

    try:
        return [str(resolve(source[len("gguf:"):]))]
    except (FileNotFoundError, ValueError) as e:
        raise WorkflowError(f"config key 'models.{wc.model}.source': {e}")


rule download:
    input:
        model=source_files,
        code=stage_sources("vqpipe.download", "vqpipe.synth", "vqpipe.gguf", "vqpipe.gguf_tokenizer", data=["corpus.txt"]),
    output:
        directory(SOURCE),
    params:
        model="{model}",
        source=lambda wc: config["models"][wc.model]["source"],
        seed=lambda wc: config["models"][wc.model]["seed"],
        dtype=lambda wc: config["models"][wc.model]["dtype"],
    log:
        "logs/download/{model}.log",
    threads: res("download", "threads")
    resources:
        mem_mb=res("download", "mem_mb"),
        runtime=res("download", "runtime"),
    cache: "omit-software"
    shell:
        vqpipe_cmd("download --source {params.source:q} --out {output:q} --seed {params.seed} --dtype {params.dtype}")
