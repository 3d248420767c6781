"""The README's table from the arm records (experiments/vq/results/*.json): python -m experiments.vq.table"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).with_name("results")


def main():
    rows = []
    for p in sorted(HERE.glob("*.json")):
        d = json.loads(p.read_text())
        if "texts" not in d:
            continue
        t = d["texts"]
        arm = d["arm"] + (f" L={d['L']}" if d.get("L") else "")
        width = f"mixed ({Path(d['mixed']).name})" if d.get("mixed") else f"{d['bits']}"
        cell = lambda c: (f"{t[c]['kl']['median']:.3f} [{t[c]['kl']['min']:.3f}–{t[c]['kl']['max']:.3f}] | "
                          f"{t[c]['ppl']['median']:.1f} ({t[c]['ppl']['median'] / t[c]['source_ppl']['median']:.2f}×) | "
                          f"{t[c]['top1']['median']:.3f}")
        load = f"{d['loadavg_start'][0]:.1f}–{d['loadavg_end'][0]:.1f}"
        rows.append(f"| {arm} | {width} | {d['bpw_codes_scales']:.4f} | {cell('devil')} | {cell('jargon')} | "
                    f"{d['quantize_seconds']:.0f} | {load} | {p.name} |")
    print("| arm | bits | bpw (codes + scales) | devil KL median [min–max] | devil ppl (× source) | devil top-1 | "
          "jargon KL median [min–max] | jargon ppl (× source) | jargon top-1 | quantize s | load avg | record |")
    print("| --- " * 12 + "|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
