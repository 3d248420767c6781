"""Median [min-max] per arm of an ab.sh output folder: the whole command (time -v) and the steps
(stage_time's timeline): wall, CPU-s, system time, minor faults, peak RSS; digests per arm."""
import re
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {}
for log in sorted(out.glob("*-*.log")):
    arm = log.stem.split("-")[0]
    t = log.read_text()
    r = {}
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([\d.]+)", t)
    r["wall"] = int(m.group(1)) * 60 + float(m.group(2))
    r["user+sys"] = float(re.search(r"User time \(seconds\): ([\d.]+)", t).group(1)) + \
        float(re.search(r"System time \(seconds\): ([\d.]+)", t).group(1))
    r["sys"] = float(re.search(r"System time \(seconds\): ([\d.]+)", t).group(1))
    r["faults"] = int(re.search(r"Minor \(reclaiming a frame\) page faults: (\d+)", t).group(1))
    r["rss_kib"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t).group(1))
    for key, name in (("loop", r"layer loop \(quantize_calibrated\)"), ("ref", r"reference_logits")):
        m = re.search(name + r"\s+wall\s+([\d.]+)\s+cpu\s+([\d.]+) \(sys\s+([\d.]+)(?:, minor faults\s+(\d+))?", t)
        r[f"{key} wall"], r[f"{key} cpu"], r[f"{key} sys"] = map(float, m.groups()[:3])
        if m.group(4):
            r[f"{key} faults"] = int(m.group(4))
    r["rest"] = r["wall"] - r["loop wall"]
    rows.setdefault(arm, []).append(r)
keys = ["wall", "user+sys", "sys", "faults", "rss_kib", "loop wall", "loop cpu", "loop sys", "loop faults",
        "ref wall", "ref cpu", "ref sys", "rest"]
fmt = lambda v: f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"
print(f"{'':<12}" + "".join(f"{arm + ' (n=' + str(len(v)) + ')':>40}" for arm, v in sorted(rows.items(), reverse=True)))
for k in keys:
    cells = []
    for arm, v in sorted(rows.items(), reverse=True):
        xs = [r[k] for r in v if k in r]
        cells.append(f"{fmt(statistics.median(xs))} [{fmt(min(xs))}-{fmt(max(xs))}]" if xs else "-")
    print(f"{k:<12}" + "".join(f"{c:>40}" for c in cells))
for arm, v in sorted(rows.items(), reverse=True):
    print(arm, "per run wall:", " ".join(f"{r['wall']:.1f}" for r in v), "| loop:", " ".join(f"{r['loop wall']:.1f}" for r in v))
order = out / "order.txt"
if order.exists():
    digests = {}
    for line in order.read_text().splitlines():
        p = line.split()
        if len(p) > 2 and p[2] == "digest":
            digests.setdefault(p[0], set()).add((p[3], p[5]))
    print("digests (quantized layers, reference.safetensors) per arm:", {a: sorted(d) for a, d in digests.items()})
