"""The pipeline arms' table (experiments/vq/README.md): python -m experiments.vq.pipeline_table."""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent / "results" / "pipeline"


def main():
    arms = {p.stem: json.loads(p.read_text()) for p in sorted(HERE.glob("*-*.json")) if not p.stem.startswith("decode")}
    for name, d in arms.items():
        t = d["texts"]
        print(f"| {d['codes']} | {d['bits']} | {d['bpw']:.4f} | " + " | ".join(
            f"{t[c]['kl']['median']:.3f} | {t[c]['ppl']['median']:.1f}" for c in ("devil", "jargon"))
              + f" | {d['quantize_seconds']:.0f} | {d['loadavg_start'][0]:.1f}-{d['loadavg_end_quantize'][0]:.1f} | {name}.json |")
    for name, d in arms.items():
        other = arms.get(name.replace("trellis", "scalar").rstrip("b"))
        if d["codes"] != "trellis" or other is None:
            continue
        for c in ("devil", "jargon"):
            a, b = d["texts"][c]["per_window"]["kl"], other["texts"][c]["per_window"]["kl"]
            r = [x / y for x, y in zip(a, b)]
            print(f"{name} / scalar {c}: median {statistics.median(r):.3f} [{min(r):.3f}-{max(r):.3f}], "
                  f"lower in {sum(x < y for x, y in zip(a, b))}/{len(r)}")
    for p in sorted(HERE.glob("decode-*.json")):
        rows = json.loads(p.read_text())
        med = {arm: statistics.median(r["tokens_per_s"] for r in rows if r["arm"] == arm) for arm in ("a", "b")}
        print(p.stem, {arm: [r["tokens_per_s"] for r in rows if r["arm"] == arm] for arm in ("a", "b")}, med,
              f"a/b {med['a'] / med['b']:.3f}", "load", [round(r["loadavg"][0], 2) for r in rows])


if __name__ == "__main__":
    main()
