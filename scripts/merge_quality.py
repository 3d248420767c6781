"""Merge bench-quality artifacts of one model run as several processes (--bits / --arms splits).

    python scripts/merge_quality.py OUT.json PART.json...

Records are concatenated (bits, then the arm order of bench-quality); the source record, text and
settings must agree across parts (the source's perplexity is recomputed identically by each part);
generations keep the source once and every arm's in the same order.
"""

import json
import sys

ORDER = ["vqpipe", "unrotated", "affine-g32", "affine-g64", "affine-g128"]


def merge(parts):
    base = dict(parts[0])
    for p in parts[1:]:
        for key in ("model", "windows", "length", "text"):
            if p[key] != base[key]:
                raise ValueError(f"parts disagree on {key!r}")
        if abs(p["source"]["nll_mean"] - base["source"]["nll_mean"]) > 1e-6:
            raise ValueError("parts disagree on the source's perplexity")
    records = [r for p in parts for r in p["records"]]
    records.sort(key=lambda r: (r["bits"], ORDER.index(r["method"]) if r["method"] in ORDER else 99))
    arms = {a["arm"]: a for p in parts for a in p["generations"]["arms"]}
    rank = {f"{r['bits']}-bit {r['method']}": i for i, r in enumerate(records)}
    base["records"] = records
    base["generations"] = {**parts[0]["generations"],
                           "arms": sorted(arms.values(), key=lambda a: rank.get(a["arm"], -1))}
    base["environment"] = parts[0]["environment"]
    base["merged_from"] = len(parts)
    return base


if __name__ == "__main__":
    out, *paths = sys.argv[1:]
    doc = merge([json.loads(open(p).read()) for p in paths])
    with open(out, "w") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
