"""A bench-quality artifact as a markdown table: every arm on every text, median [min-max] over windows.

    python scripts/quality_table.py results/bench/smollm2/quality.json
"""

import json
import sys


def st(s, digits=3):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def ppl(t):
    p = t["ppl"]
    f = (lambda x: f"{x:.2f}") if p["max"] < 1e4 else (lambda x: f"{x:.3g}")
    return f"{f(p['median'])} [{f(p['min'])}–{f(p['max'])}] ({f(t['ppl_mean'])})"


def table(doc):
    texts = list(doc.get("texts") or {"devil": None})
    src = doc["source"]
    head = ["bits", "arm", "bpw (all matrices)", "bpw (quantized layers)"]
    for c in texts:
        head += [f"KL {c}", f"ppl {c} (mean)", f"top-1 {c}"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    row = ["—", "source", "—", "—"]
    for c in texts:
        row += ["—", ppl(src["texts"][c] if "texts" in src else src), "—"]
    lines.append("| " + " | ".join(row) + " |")
    for r in sorted(doc["records"], key=lambda r: -r["bits"]):
        if "skipped" in r:
            lines.append(f"| {r['bits']} | {r['method']} | refused: {r['skipped']} |" + " |" * (len(head) - 3))
            continue
        row = [str(r["bits"]), r["method"], f"{r['bpw']['bpw_matrices']:.4f}", f"{r['bpw']['bpw']:.4f}"]
        for c in texts:
            t = r["texts"][c] if "texts" in r else r
            row += [st(t["kl"]), ppl(t), f"{t['top1']['median']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(open(sys.argv[1]))))
