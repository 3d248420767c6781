"""Report stage: artifact records -> ``index.html`` (self-contained), ``report.md``, ``summary.json``,
``plots/*.png`` and ``tables/*.html``.

``vqpipe report --inputs FILE_OR_DIR ... --out results/report``. Every input is a record
(vqpipe/store/record.py) checked against workflow/schemas/record.schema.json; a malformed one stops the
report with the file and the field named. The work is split in three: vqpipe/report/summary.py (records ->
figures, no MLX), vqpipe/report/plots.py (figures -> PNG) and vqpipe/report/render.py (figures -> pages, through
the jinja2 templates in vqpipe/report/templates/). Snakemake's ``--report`` shows the plots and the
tables with the captions of workflow/report/ (workflow/rules/report.smk).
"""

import argparse
import json
import sys
from pathlib import Path

from ..store.fsutil import write_bytes
from ..report.plots import PLOTS, all_plots
from ..store.record import RecordError
from ..report.render import TABLES, pages
from ..report.summary import KINDS, summary as build

__all__ = ["KINDS", "OUTPUTS", "PLOTS", "TABLES", "main", "make_report"]

OUTPUTS = (("index.html", "report.md", "summary.json") + tuple(f"plots/{p}.png" for p in PLOTS)
           + tuple(f"tables/{t}.html" for t in TABLES))


def make_report(inputs, out_dir):
    """Write every file of OUTPUTS under ``out_dir``; returns the summary. RecordError on a bad input."""
    out_dir = Path(out_dir)
    summary = build(inputs)
    plots = all_plots(summary)
    for name, png in plots.items():
        write_bytes(out_dir / "plots" / f"{name}.png", png)
    for name, text in pages(summary, plots).items():
        write_bytes(out_dir / name, text)
    write_bytes(out_dir / "summary.json", json.dumps(summary, indent=1, default=str))
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(prog="vqpipe report", description="Aggregate artifacts into the report.")
    p.add_argument("--inputs", nargs="+", required=True, help="JSON artifacts or directories holding them")
    p.add_argument("--out", default="results/report", help="output directory (default: results/report)")
    args = p.parse_args(argv)
    from ..store.manifest import ManifestError, verify

    try:  # records of a shared cache (quantized.json, pack.json) are checked against their manifest first
        for d in sorted({Path(i).parent for i in args.inputs if Path(i).is_file()}):
            verify(d)
        summary = make_report(args.inputs, args.out)
    except (ManifestError, RecordError) as e:
        print(f"vqpipe report: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {len(summary['inputs'])} artifacts -> {args.out}/index.html"
          + (f"; missing: {', '.join(summary['missing'])}" if summary["missing"] else ""))
    for w in summary["warnings"]:
        print(f"report: warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
