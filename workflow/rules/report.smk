# report: every stage's record -> results/report/{index.html, report.md, summary.json, plots/*.png,
# tables/*.html}; the plots, the tables (one HTML page each), report.md and summary.json go into
# `snakemake --report report.html` with the captions of workflow/report/. Every record is checked
# against workflow/schemas/record.schema.json: a malformed one fails the job, naming file and field.


rule report:
    input:
        verdicts=fan_out(VERDICT),
        quantized=fan_out(QUANTIZED),
        reservoirs=fan_out(RESERVOIR),
        bench=bench_outputs(),
        code=stage_sources("vqpipe.stages.report"),
        templates=[local(t) for t in REPORT_TEMPLATES],
        schema=local("workflow/schemas/record.schema.json"),
    output:
        # index.html is the same report as one self-contained page: not nested in Snakemake's own.
        html="results/report/index.html",
        md=report(
            "results/report/report.md", caption="../report/report_md.rst", category="Report",
            labels={"file": "report.md"},
        ),
        summary=report(
            "results/report/summary.json", caption="../report/summary.rst", category="Report",
            labels={"file": "summary.json"},
        ),
        plots=[
            report(
                f"results/report/plots/{p}.png", caption=f"../report/{p}.rst", category="Plots",
                labels={"plot": p},
            )
            for p in REPORT_PLOTS
        ],
        tables=[
            report(
                f"results/report/tables/{t}.html", caption=f"../report/table_{t}.rst", category="Tables",
                labels={"table": t},
            )
            for t in REPORT_TABLES
        ],
    params:
        inputs=lambda wc, input: list(input.verdicts)
        + [f"{d}/quantized.json" for d in input.quantized]
        + [f"{d}/pack.json" for d in input.reservoirs]
        + list(input.bench),
        # The output directory as Snakemake maps it (a local copy under a storage provider).
        out=lambda wc, output: os.path.dirname(output.html),
    log:
        "logs/report.log",
    conda:
        ENV
    shell:
        vqpipe_cmd("report --inputs {params.inputs:q} --out {params.out:q}")
