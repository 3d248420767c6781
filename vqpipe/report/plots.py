"""The report's plots: summary (vqpipe/report/summary.py) -> PNG bytes, one function per plot (matplotlib, Agg).

Every plot is written even without data: it then says which artifact is missing.
"""

import io
from pathlib import Path

PLOTS = ("quality_bits", "load_time", "decode_context", "kernel_speedup", "roofline")


def _figure(ncols=1, width=6.5, height=4.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def _png(fig):
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _no_data(title, why):
    fig, (ax,) = _figure(height=2.0)
    ax.text(0.5, 0.5, why, ha="center", va="center")
    ax.set_axis_off()
    ax.set_title(title)
    return _png(fig)


def _yerr(recs, scale=1.0):
    return [[(r["median"] - r["min"]) * scale for r in recs], [(r["max"] - r["median"]) * scale for r in recs]]


def plot_load(summary):
    rows = [(m, r) for m, vs in summary["models"].items() for d in vs.values() for r in d.get("load", [])]
    if not rows:
        return _no_data("load time", "no bench-load artifact among the inputs")
    fig, (ax,) = _figure(width=8, height=max(3.0, 0.35 * len(rows) + 1.5))
    for y, (_, r) in enumerate(rows):  # points, not bars: a bar's length means nothing on a log axis
        ax.errorbar(r["median"], y, xerr=_yerr([r]), fmt="o", capsize=4,
                    color="C1" if str(r.get("arm", "")).startswith("requant") else "C0")
    ax.set_yticks(range(len(rows)), [f"{m} / {r.get('arm')}" for m, r in rows], fontsize=8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on a short log axis
    ax.set_xlabel("seconds (median, bars: min-max)")
    ax.set_title(f"load time per variant (n = {', '.join(sorted({str(r['n']) for _, r in rows}))})")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return _png(fig)


def _peak(r):
    """(bytes, which): the generation's own peak (``peak_over_start_bytes``) where recorded, else the
    process peak (``peak_memory_bytes``, every resident model included)."""
    if isinstance(r.get("peak_over_start_bytes"), (int, float)):
        return r["peak_over_start_bytes"], "own"
    if isinstance(r.get("peak_memory_bytes"), (int, float)):
        return r["peak_memory_bytes"], "process"
    return None, None


def plot_decode(summary):
    series = {}
    runs = {r.get("run") for vs in summary["models"].values() for d in vs.values() for r in d.get("decode", [])}
    for m, vs in summary["models"].items():
        for v, d in vs.items():
            for r in d.get("decode", []):
                if isinstance(r.get("context"), (int, float)):
                    run = f" [{r.get('run')}]" if len(runs) > 1 else ""
                    series.setdefault(f"{m} / {r.get('arm') or v}{run}", []).append(r)
    if not series:
        return _no_data("decode vs context", "no bench-decode artifact with decode records among the inputs")
    fig, (a1, a2) = _figure(2, width=7.5, height=5.0)
    which = set()
    for label, recs in series.items():
        recs = sorted(recs, key=lambda r: r["context"])
        x = [r["context"] for r in recs]
        a1.errorbar(x, [r["median"] for r in recs], yerr=_yerr(recs), marker="o", capsize=3, label=label)
        mem = [(r["context"], _peak(r)) for r in recs]
        mem = [(x, b / 2**20) for x, (b, w) in mem if b is not None]
        which.update(_peak(r)[1] for r in recs if _peak(r)[1])
        if mem:
            a2.plot(*zip(*mem), marker="o", label=label)
    a1.set_ylabel("decode tok/s (median, bars: min-max)")
    a1.set_title("decode throughput against context")
    a2.set_ylabel({frozenset({"own"}): "generation's own peak (MiB, peak_over_start_bytes)",
                   frozenset({"process"}): "process peak (MiB, mx.get_peak_memory)"}.get(
                       frozenset(which), "peak (MiB): own where recorded, else process"))
    a2.set_title("peak memory against context (pilot round, one sample)")
    for ax in (a1, a2):
        ax.set_xlabel("context length (tokens)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    a2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # one legend, outside: same series both sides
    return _png(fig)


def _kernel_label(c, arm=None):
    parts = [str(c.get("op") or "?")] + ([str(c["mode"])] if c.get("mode") else [])
    return " ".join(parts) + (f" {arm}" if arm else f": {c.get('other_arm')} vs {c.get('baseline_arm')}")


def plot_kernels(summary):
    comps = [c for c in summary["kernels"]["comparisons"] if isinstance(c.get("S"), (int, float))]
    recs = [r for r in summary["kernels"]["records"] if isinstance(r.get("S"), (int, float))]
    if not comps and not recs:
        return _no_data("kernel speedup", "no bench-kivi artifact among the inputs")
    fig, (ax,) = _figure(width=8)
    if comps:
        groups = {}
        for c in comps:
            groups.setdefault(_kernel_label(c), []).append(c)
        for label, cs in groups.items():
            cs = sorted(cs, key=lambda c: c["S"])
            x, y = [c["S"] for c in cs], [c["speedup"] for c in cs]
            lo = [c["baseline"]["min"] / c["other"]["max"] for c in cs]
            hi = [c["baseline"]["max"] / c["other"]["min"] for c in cs]
            line = ax.errorbar(x, y, yerr=[[b - a for a, b in zip(lo, y)], [b - a for a, b in zip(y, hi)]],
                               marker="o", capsize=3, label=label)
            f = [c.get("floor") or 0.0 for c in cs]
            ax.fill_between(x, [1 / (1 + v) for v in f], [1 + v for v in f], color=line[0].get_color(), alpha=0.12)
        ax.axhline(1.0, color="black", lw=1)
        ax.set_ylabel("speedup (median; bars: min-max; band: noise floor)")
        ax.set_title("kernel speedup against S")
    else:  # no kernel arm on this backend: the reference timings, so the sweep is still visible
        groups = {}
        for r in recs:
            if not str(r.get("arm", "")).endswith("(A/A)"):
                groups.setdefault(_kernel_label(r, r.get("arm")), []).append(r)
        for label, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["S"])
            ax.errorbar([r["S"] for r in rs], [r["median"] * 1e6 for r in rs], yerr=_yerr(rs, 1e6), marker="o",
                        capsize=3, label=label)
        ax.set_yscale("log")
        ax.set_ylabel("µs per call (median, bars: min-max)")
        ax.set_title("kernel time against S (no kernel arm on this backend: no speedup to show)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (sequence length)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def plot_roofline(summary):
    rows = [r for r in summary["roofline"] if r.get("intensity") and r.get("flops_per_s") and r.get("peak_flops")]
    if not rows:
        return _no_data("roofline", "no bench-decode artifact with roofline figures among the inputs")
    rows = [r for r in rows if r["path"] == rows[0]["path"]]  # the roofs hold only for points of the same run
    fig, (ax,) = _figure(width=10, height=max(4.2, 0.2 * len(rows) + 1.0))
    points = [{"label": f"{r['model']} {r['precision']} {r['phase']} @{r['context']}", "intensity": r["intensity"],
               "flops_per_s": r["flops_per_s"]["median"], "phase": r["phase"]} for r in rows]
    bw, fl = rows[0]["peak_bandwidth"], rows[0]["peak_flops"]
    draw_roofline(ax, bw["median"], fl["median"], points)
    ax.set_title(f"roofline of {Path(rows[0]['path']).name}: copy {bw['median'] / 1e9:.0f} GB/s, "
                 f"{fl.get('dtype') or ''} GEMM {fl['median'] / 1e12:.0f} TFLOP/s (medians)", fontsize=9)
    return _png(fig)


def draw_roofline(ax, peak_bandwidth, peak_flops, points):
    """Draw a roofline on a matplotlib ``ax``.

    ``points``: dicts with ``label``, ``intensity`` (FLOP/byte), ``flops_per_s`` and ``phase``
    ("decode" = circles, "prefill" = squares).
    """
    xs = [p["intensity"] for p in points] or [1.0]
    lo, hi = min(xs + [0.05]) / 2, max(xs + [peak_flops / peak_bandwidth]) * 4
    import numpy as np

    grid = np.geomspace(lo, hi, 200)
    ax.plot(grid, np.minimum(grid * peak_bandwidth, peak_flops), color="black", lw=1.5, label="roof")
    ax.axvline(peak_flops / peak_bandwidth, color="grey", ls=":", lw=1)
    for p in points:
        ax.scatter(p["intensity"], p["flops_per_s"], marker="o" if p["phase"] == "decode" else "s", label=p["label"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"roofline: {peak_bandwidth / 1e9:.1f} GB/s copy, {peak_flops / 1e9:.1f} GFLOP/s fp32 GEMM")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))


_MARKERS = "os^vDP*Xh<>p"


def plot_quality(summary):
    """KL and perplexity against bits per weight, one row per model, every bench-quality arm a series;
    the frontier (no arm both smaller and closer to the source) dashed."""
    models = {m: q for m, q in summary.get("quality", {}).items() if q["points"]}
    if not models:
        return _no_data("quality against bits per weight", "no bench-quality artifact among the inputs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.4 * len(models)), squeeze=False)
    for (model, q), (a_kl, a_ppl) in zip(models.items(), axes):
        arms = sorted({p["arm"] for p in q["points"]}, key=lambda a: (a not in ("vqpipe", "rotated"), a))
        for i, arm in enumerate(arms):
            pts = sorted((p for p in q["points"] if p["arm"] == arm), key=lambda p: p["bpw"])
            style = dict(marker=_MARKERS[i % len(_MARKERS)], label=arm, ms=7 if i else 9, lw=2.2 if i == 0 else 1.2,
                         color="C3" if arm in ("vqpipe", "rotated") else f"C{i if i < 3 else i + 1}")
            a_kl.plot([p["bpw"] for p in pts], [p["kl"] for p in pts], **style)
            a_ppl.plot([p["bpw"] for p in pts], [p["ppl"] for p in pts], **style)
        front = [p for key in q["frontier"] for p in q["points"] if (p["arm"], p["bits"]) == tuple(key)]
        if front:
            a_kl.plot([p["bpw"] for p in front], [p["kl"] for p in front], ls="--", color="grey", lw=1,
                      label="frontier (no other format smaller with lower KL)", zorder=0)
        if isinstance(q.get("source_ppl"), (int, float)):
            a_ppl.axhline(q["source_ppl"], color="black", lw=1, ls=":", label=f"source ({q['source_ppl']:.4g})")
        kind = " (synthetic: random weights)" if q.get("synthetic") else ""
        a_kl.set_title(f"{model}{kind}: KL to the source (median over windows; lower is better)", fontsize=9)
        a_ppl.set_title(f"{model}{kind}: perplexity on the eval text (all tokens; lower is better)", fontsize=9)
        a_kl.set_yscale("log")
        a_ppl.set_yscale("log")
        for ax in (a_kl, a_ppl):
            ax.set_xlabel("bits per weight (stored, every matrix)")
            ax.grid(True, which="both", alpha=0.3)
        a_kl.set_ylabel("KL(source || arm), nats/token")
        a_ppl.set_ylabel("perplexity")
        a_ppl.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        a_kl.legend(fontsize=7, loc="upper right")
    return _png(fig)


def all_plots(summary):
    """{name: PNG bytes} of every plot in PLOTS."""
    return {"quality_bits": plot_quality(summary), "load_time": plot_load(summary), "decode_context": plot_decode(summary),
            "kernel_speedup": plot_kernels(summary), "roofline": plot_roofline(summary)}
