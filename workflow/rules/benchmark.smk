# Benchmarks: timings are not deterministic, so these rules are never cached (and they use
# `benchmark:`, which a cached rule could not). Each writes one JSON for the report.
# vqpipe.kivi.kernels: the environment record (vqpipe/bench/env.py) imports it inside a function.


rule bench_quality_reference:
    # The source's side of every evaluation window, once: its probabilities (float32, 100 MB a
    # window for SmolLM2: temporary), entropy, argmax and generations, read by every arm job.
    input:
        source=SOURCE,
        code=stage_sources("vqpipe.stages.bench_quality", "vqpipe.kivi.kernels"),
    output:
        temp(directory(BENCH_QUALITY_REFERENCE)),
    params:
        windows=config["benchmarks"]["quality"]["windows"],
        length=config["benchmarks"]["quality"]["length"],
        gen_prompts=config["benchmarks"]["quality"]["gen_prompts"],
        gen_tokens=config["benchmarks"]["quality"]["gen_tokens"],
        texts=" ".join(config["benchmarks"]["quality"]["texts"]),
        blas=BLAS,
    log:
        "logs/bench/{model}/quality.reference.log",
    benchmark:
        "results/benchmarks/bench_quality/{model}.reference.tsv"
    priority: PRIORITY["source_only"]
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "bench-quality --source {input.source:q} --windows {params.windows} --length {params.length}"
            " --gen-prompts {params.gen_prompts} --gen-tokens {params.gen_tokens} --texts {params.texts}"
            " --reference-out {output:q}"
        )


rule bench_quality_arm:
    # One arm at one bit width against the shared reference. The vqpipe arms are the quantize
    # stage's artifacts (the pipeline's rotation, and none), so every quantize option reaches
    # them; the affine arms are made in the job from the source alone, so they run while the
    # calibrated model is still being quantized.
    input:
        source=SOURCE,
        reference=BENCH_QUALITY_REFERENCE,
        quantized=quality_artifact,
        code=stage_sources("vqpipe.stages.bench_quality", "vqpipe.kivi.kernels"),
    output:
        temp(BENCH_QUALITY_PART),
    params:
        model="{model}",
        rotation=QUALITY_ROTATION,
        windows=config["benchmarks"]["quality"]["windows"],
        length=config["benchmarks"]["quality"]["length"],
        seed=config["benchmarks"]["quality"]["seed"],
        groups=config["benchmarks"]["quality"]["affine_groups"],
        # the affine arms quantize the embedding where the vqpipe artifacts do (checked at the merge)
        embeddings=lambda w: "--embeddings" if quantize_option(w.model, "embeddings") else "--no-embeddings",
        calib=quality_calib_flags,
        texts=" ".join(config["benchmarks"]["quality"]["texts"]),
        blas=BLAS,
    log:
        "logs/bench/{model}/quality.b{bits}-{arm}.log",
    benchmark:
        "results/benchmarks/bench_quality/{model}.b{bits}-{arm}.tsv"
    priority: quality_arm_priority
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "bench-quality --source {input.source:q} --reference {input.reference:q} --model {params.model}"
            " --bits {wildcards.bits} --arms {wildcards.arm} --rotation {params.rotation}"
            " --affine-groups {params.groups} --windows {params.windows} --length {params.length}"
            " --seed {params.seed} --quantized {input.quantized:q} {params.embeddings} --texts {params.texts}"
            " {params.calib} --out {output:q}"
        )


rule bench_quality:
    input:
        parts=quality_parts,
        code=stage_sources("vqpipe.stages.bench_quality", "vqpipe.kivi.kernels"),
    output:
        BENCH_QUALITY,
    params:
        expect=quality_expected(),
    log:
        "logs/bench/{model}/quality.log",
    threads: 1
    conda:
        ENV
    shell:
        vqpipe_cmd("bench-quality --merge {input.parts:q} --expect {params.expect} --out {output:q}")


rule bench_load:
    input:
        source=SOURCE,
        # It quantizes and packs in-process and loads reservoirs in fresh ones.
        code=stage_sources("vqpipe.stages.bench_load", "vqpipe.stages.quantize", "vqpipe.store.reservoir", "vqpipe.kivi.kernels"),
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
    priority: PRIORITY["source_only"]
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
        code=stage_sources("vqpipe.stages.bench_decode", "vqpipe.store.reservoir", data=["corpus.txt"]),
    output:
        BENCH_DECODE,
    params:
        model="{model}",
        options=decode_options(),
        kivi_ops=lambda wc, input: f"--kivi-ops {input.kivi_ops[0]}" if input.kivi_ops else "",
        blas=BLAS,
    log:
        "logs/bench/{model}/decode.log",
    priority: PRIORITY["source_only"]
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
    # bench-decode waits for it: at the default priority it ran among the last short jobs and
    # bench-decode (~27 s) became the run's tail, one core idle (docs/run-time.md).
    priority: PRIORITY["source_only"] if config["benchmarks"]["decode"]["enabled"] else PRIORITY["rest"]
    benchmark:
        "results/benchmarks/bench_kivi.tsv"
    conda:
        ENV
    shell:
        vqpipe_cmd("bench-kivi {params.quick} --bits {params.bits} --dtype {params.dtype} --out {output:q}")


rule bench_kv_quality:
    input:
        # the reservoir bench-decode measures (the README's), once it passed validation
        reservoir=decode_artifact(RESERVOIR),
        verdict=decode_artifact(VERDICT),
        code=stage_sources("vqpipe.stages.bench_kv_quality", "vqpipe.store.reservoir"),
    output:
        BENCH_KV_QUALITY,
    params:
        model="{model}",
        windows=config["benchmarks"]["kv_quality"]["windows"],
        length=config["benchmarks"]["kv_quality"]["length"],
        chunk=config["benchmarks"]["kv_quality"]["chunk"],
        kinds=" ".join(config["benchmarks"]["kv_quality"]["kinds"]),
        blas=BLAS,
    log:
        "logs/bench/{model}/kv_quality.log",
    benchmark:
        "results/benchmarks/bench_kv_quality/{model}.tsv"
    conda:
        ENV
    shell:
        vqpipe_cmd(
            "bench-kv-quality --model-dir {input.reservoir:q} --model {params.model} --windows {params.windows}"
            " --length {params.length} --chunk {params.chunk} --kinds {params.kinds} --out {output:q}"
        )
