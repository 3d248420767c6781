# Benchmarks: timings are not deterministic, so these rules are never cached (and they use
# `benchmark:`, which a cached rule could not). Each writes one JSON for the report.


rule bench_quality_shard:
    # One slice of the evaluation windows (benchmarks.quality.shards of them, run in parallel);
    # the per-window values are exact whatever the split, and bench_quality joins them.
    input:
        source=SOURCE,
        # The vqpipe arms are the quantize stage's artifacts (the pipeline's rotation and none),
        # so every quantize option reaches them; affine arms are made in the job.
        quantized=expand(QUANTIZED, model="{model}", bits=BITS, rotation=[QUALITY_ROTATION, "none"]),
        code=stage_sources("vqpipe.stages.bench_quality"),
    output:
        temp(BENCH_QUALITY_SHARD),
    params:
        model="{model}",
        bits=BITS,
        rotation=QUALITY_ROTATION,
        windows=config["benchmarks"]["quality"]["windows"],
        length=config["benchmarks"]["quality"]["length"],
        seed=config["benchmarks"]["quality"]["seed"],
        groups=config["benchmarks"]["quality"]["affine_groups"],
        gen_prompts=config["benchmarks"]["quality"]["gen_prompts"],
        gen_tokens=config["benchmarks"]["quality"]["gen_tokens"],
        shards=QUALITY_SHARDS,
        blas=BLAS,
    log:
        "logs/bench/{model}/quality.shard{shard}.log",
    benchmark:
        "results/benchmarks/bench_quality/{model}.shard{shard}.tsv"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "bench-quality --source {input.source:q} --model {params.model} --bits {params.bits}"
            " --quantized {input.quantized:q} --rotation {params.rotation} --affine-groups {params.groups}"
            " --windows {params.windows} --length {params.length} --seed {params.seed}"
            " --gen-prompts {params.gen_prompts} --gen-tokens {params.gen_tokens}"
            " --shard {wildcards.shard}/{params.shards} --out {output:q}"
        )


rule bench_quality:
    input:
        shards=expand(BENCH_QUALITY_SHARD, model="{model}", shard=range(QUALITY_SHARDS)),
        code=stage_sources("vqpipe.stages.bench_quality"),
    output:
        BENCH_QUALITY,
    log:
        "logs/bench/{model}/quality.log",
    threads: 1
    conda:
        ENV
    shell:
        vqpipe_cmd("bench-quality --merge {input.shards:q} --out {output:q}")


rule bench_load:
    input:
        source=SOURCE,
        # It quantizes and packs in-process and loads reservoirs in fresh ones.
        code=stage_sources("vqpipe.stages.bench_load", "vqpipe.stages.quantize", "vqpipe.reservoir"),
    output:
        BENCH_LOAD,
    params:
        model="{model}",
        bits=config["benchmarks"]["load"]["bits"],
        rotations=config["benchmarks"]["load"]["rotations"],
        repeats=config["benchmarks"]["load"]["repeats"],
        arm_budget=config["benchmarks"]["load"]["arm_budget"],
        procs=config["benchmarks"]["load"]["procs"],
        blas=BLAS,
    log:
        "logs/bench/{model}/load.log",
    benchmark:
        "results/benchmarks/bench_load/{model}.tsv"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "bench-load --source {input.source:q} --model {params.model} --bits {params.bits}"
            " --rotations {params.rotations} --repeats {params.repeats} --arm-budget {params.arm_budget}"
            " --procs {params.procs} --out {output:q}"
        )


rule bench_decode:
    input:
        source=SOURCE,
        reservoir=decode_artifact(RESERVOIR),
        # Only a reservoir that passed validation is benchmarked.
        verdict=decode_artifact(VERDICT),
        # bench-kivi's per-flush times feed the Amdahl prediction.
        kivi_ops=[BENCH_KIVI] if config["benchmarks"]["kivi"]["enabled"] else [],
        code=stage_sources("vqpipe.stages.bench_decode", "vqpipe.reservoir", data=["corpus.txt"]),
    output:
        BENCH_DECODE,
    params:
        model="{model}",
        options=decode_options(),
        kivi_ops=lambda wc, input: f"--kivi-ops {input.kivi_ops[0]}" if input.kivi_ops else "",
        blas=BLAS,
    log:
        "logs/bench/{model}/decode.log",
    benchmark:
        "results/benchmarks/bench_decode/{model}.tsv"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "bench-decode --source {input.source:q} --reservoir {input.reservoir:q} --model {params.model}"
            " {params.options} {params.kivi_ops} --out {output:q}"
        )


rule bench_kivi:
    input:
        code=stage_sources("vqpipe.stages.bench_kivi"),
    output:
        BENCH_KIVI,
    params:
        quick="--quick" if config["benchmarks"]["kivi"]["quick"] else "",
        bits=config["benchmarks"]["kivi"]["bits"],
        dtype=config["benchmarks"]["kivi"]["dtype"],
        blas=BLAS,
    log:
        "logs/bench/kivi.log",
    benchmark:
        "results/benchmarks/bench_kivi.tsv"
    conda:
        ENV
    shell:
        vqpipe_cmd("bench-kivi {params.quick} --bits {params.bits} --dtype {params.dtype} --out {output:q}")
