"""Report stage: every JSON artifact -> ``index.html`` (self-contained), ``report.md`` and ``summary.json``.

``python -m vqpipe report --inputs FILE_OR_DIR ... --out results/report``. Every figure comes from the
artifacts (shapes in docs/benchmarking.md); kinds that are absent are listed as missing. Plots are
written to ``plots/*.png`` (referenced by report.md) and embedded as base64 in index.html.
"""

import argparse
import base64
import hashlib
import html
import io
import json
import sys
from pathlib import Path

from . import numerics
from .fsutil import write_bytes
from .bench import roofline as rl

KINDS = ("quantize", "pack", "validate", "bench-load", "bench-decode", "bench-kivi", "bench-quality")
PLOTS = ("load_time", "decode_context", "kernel_speedup", "roofline")
OUTPUTS = ("index.html", "report.md", "summary.json") + tuple(f"plots/{p}.png" for p in PLOTS)
_STAT_KEYS = ("n", "median", "min", "max")
_NOT_COPIED = ("environment", "reference_environment", "layers")
# bench-quality's methods, as pipeline variants (quality.py: rotated = rotation auto, unrotated = none).
_QUALITY_VARIANT = {"rotated": "b{bits}-auto", "unrotated": "b{bits}-none", "affine": "mlx-affine-b{bits}",
                    "vqpipe": "b{bits}-{rotation}", "affine-g32": "mlx-affine-b{bits}-g32",
                    "affine-g64": "mlx-affine-b{bits}-g64", "affine-g128": "mlx-affine-b{bits}-g128"}


# --- reading artifacts -------------------------------------------------------------------------


def _is_stats(x):
    return isinstance(x, dict) and all(k in x for k in _STAT_KEYS)


def _stats(rec):
    """A record's {n, median, min, max}; a bare numeric ``value`` is one observation."""
    if _is_stats(rec):
        return {k: rec[k] for k in _STAT_KEYS}
    if isinstance(rec.get("value"), (int, float)) and not isinstance(rec.get("value"), bool):
        v = rec["value"]
        return {"n": rec.get("n", 1), "median": v, "min": v, "max": v}
    return None


def _items(doc, key):
    """The dict entries of a list under ``key``; anything else is ignored rather than fatal."""
    items = doc.get(key)
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def _scalars(doc, drop=()):
    return {k: v for k, v in doc.items() if k not in drop and (v is None or isinstance(v, (str, int, float, bool)))}


def _comparison(c):
    return _is_stats(c.get("baseline")) and _is_stats(c.get("other")) and isinstance(c.get("speedup"), (int, float))


def _kind_of(path, doc):
    if not isinstance(doc, dict):
        return None
    kind = doc.get("kind") or doc.get("stage")
    if isinstance(kind, str) and kind:
        return kind
    if path.name == "quantized.json":
        return "quantize"
    if "bit_exact" in doc:
        return "validate"
    return None


def _from_path(path, depth):
    """(model, variant[, persist]) from the results/ layout, ``depth`` directories up."""
    parts = path.resolve().parent.parts
    return parts[-depth:] if len(parts) >= depth else (None,) * depth


def _quantize(a):
    doc, path = a["doc"], Path(a["path"])
    model, variant = _from_path(path, 2)
    ref = path.with_name("reference.json")
    env = doc.get("environment")
    if env is None and ref.is_file():  # the quantize stage records its environment next to the logits
        try:
            env = json.loads(ref.read_text()).get("environment")
        except (OSError, json.JSONDecodeError):
            env = None
    layers = _items(doc, "records")
    rel = [r["rel_mse"] for r in layers if isinstance(r.get("rel_mse"), (int, float))]
    info = _scalars(doc, drop=("kind",))
    info.update(model=doc.get("model") or model, variant=doc.get("variant") or variant, layers=len(layers))
    if rel:
        info["layer_rel_mse"] = _summ(rel)
    a.update(model=info["model"], variant=info["variant"], environment=env, info=info)


def _pack(a):
    doc = a["doc"]
    model, variant, persist = _from_path(Path(a["path"]), 3)
    info = _scalars(doc, drop=("kind",))
    info.update(model=doc.get("model") or model, variant=doc.get("variant") or variant,
                persist=persist.removeprefix("persist-") if persist else None)
    a.update(model=info["model"], variant=info["variant"], info=info)


def _validate(a):
    doc = a["doc"]
    info = _scalars(doc, drop=("kind",))
    p = doc.get("persist_rotation")
    info["persist_rotation"] = {True: "on", False: "off"}.get(p, p)
    a.update(model=doc.get("model"), variant=doc.get("variant"), info=info)


def _kivi(a):
    """bench-kivi rows (``results``: one per S, kind and mode with per-arm summaries) -> records and
    comparisons; an artifact already in the generic shape passes through."""
    doc = a["doc"]
    recs, comps = list(_items(doc, "records")), [c for c in _items(doc, "comparisons") if _comparison(c)]
    for row in _items(doc, "results"):
        arms = {k: v for k, v in (row.get("arms") or {}).items() if _is_stats(v)}
        floors = row.get("noise_floor") if isinstance(row.get("noise_floor"), dict) else {}
        ident = {"op": row.get("kind"), "mode": row.get("mode"), "S": row.get("S")}
        for arm, st in arms.items():
            recs.append({**ident, "arm": arm, "unit": "s", **st, "noise_floor": floors.get(arm)})
        if "speedup" in row and "reference" in arms and "kernel" in arms:
            base, other = arms["reference"], arms["kernel"]
            floor = max([f for f in floors.values() if isinstance(f, (int, float))], default=None)
            comps.append({**ident, "baseline_arm": "reference", "other_arm": "kernel", "baseline": base, "other": other,
                          "speedup": row["speedup"], "ratio": 1 / row["speedup"], "floor": floor,
                          "verdict": row.get("verdict"),
                          **{k: row[k] for k in ("m4_speedup", "beats_m4", "outputs_equal", "kernel_bytes", "kernel_bytes_per_s",
                                                 "fraction_of_copy_bandwidth") if k in row}})
    a.update(records=recs, comparisons=comps)


def _quality(a):
    """bench-quality records hold nested summaries (``kl``, ``top1``); one record per metric here."""
    doc = a["doc"]
    recs = []
    for r in _items(doc, "records"):
        ident = _scalars(r)
        if "variant" not in r and "method" in r and "bits" in r:
            ident["variant"] = _QUALITY_VARIANT.get(r["method"], "{method}-b{bits}").format(**{"rotation": "auto", **r})
        if _stats(r):
            recs.append({**ident, **_stats(r)})
        for key, st in r.items():
            if _is_stats(st):
                mean = r.get(f"{key}_mean")
                recs.append({**ident, "metric": key, **{k: st[k] for k in _STAT_KEYS}, "mean": mean})
    timing = []
    for t in _items(doc, "timing"):
        timing.append({**_scalars(t), **{k: v for k, v in t.items() if _is_stats(v)}})
    a.update(records=recs, timing=timing)


def load_artifacts(paths):
    """Read JSON files (directories are searched recursively) -> ``{"artifacts", "missing_paths", "skipped"}``."""
    files, missing_paths, skipped, arts = {}, [], [], []
    for p in map(Path, paths):
        if p.is_dir():  # model/tokenizer JSON files live there too: those are passed over quietly
            files.update((f, False) for f in sorted(p.rglob("*.json")) if f not in files)
        elif p.is_file():
            files[p] = True
        else:
            missing_paths.append(str(p))
    passed_over = 0
    for f, explicit in files.items():
        raw = f.read_bytes()
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            skipped.append({"path": str(f), "reason": f"not JSON: {e}"})
            continue
        kind = _kind_of(f, doc)
        if kind is None:
            if explicit:
                skipped.append({"path": str(f), "reason": "no 'kind' (not a vqpipe artifact)"})
            passed_over += not explicit
            continue
        a = {"path": str(f), "kind": kind, "doc": doc, "sha256": hashlib.sha256(raw).hexdigest(),
             "model": doc.get("model"), "variant": doc.get("variant"), "environment": doc.get("environment"),
             "records": _items(doc, "records"), "comparisons": [c for c in _items(doc, "comparisons") if _comparison(c)]}
        {"quantize": _quantize, "pack": _pack, "validate": _validate, "bench-kivi": _kivi,
         "bench-quality": _quality}.get(kind, lambda a: None)(a)
        arts.append(a)
    return {"artifacts": arts, "missing_paths": missing_paths, "skipped": skipped, "passed_over": passed_over}


# --- summary -----------------------------------------------------------------------------------


def _env_key(env):
    return json.dumps({k: v for k, v in env.items() if k not in ("device_info", "loadavg")}, sort_keys=True, default=str)


def _roofline_rows(a):
    """Achieved bandwidth and roofline points of a bench-decode artifact (roofs from the same run)."""
    roof = a["doc"].get("roofline") or {}
    bw, fl = roof.get("copy_bandwidth"), roof.get("matmul_flops")
    if not (_is_stats(bw) and bw["median"]):
        return []
    n_params = roof.get("matmul_params")
    rows = []
    for rec in a["records"]:
        st = _stats(rec)
        if st is None or rec.get("phase") not in ("decode", "prefill") or "weight_bytes" not in rec:
            continue
        ctx = rec.get("context", 0)
        kv = rec.get("kv_bytes_per_position", 0)
        bpt = rec.get("bytes_per_token") or rl.decode_bytes_per_token(rec["weight_bytes"], kv, ctx)
        fpt = rec.get("flops_per_token") or (rl.flops_per_token(n_params) if n_params else None)
        row = {"model": rec.get("model") or a["model"], "arm": rec.get("arm"), "variant": rec.get("variant") or rec.get("arm"),
               "precision": rec.get("precision") or rec.get("arm"), "phase": rec["phase"], "context": ctx,
               "mean_context": rec.get("mean_context"), "tok_s": st,
               "peak_bandwidth": bw, "peak_flops": fl if _is_stats(fl) else None, "path": a["path"]}
        if rec["phase"] == "decode":
            row["bytes_per_token"] = bpt
            row["achieved"] = {k: rl.achieved(bpt, st[k], bw["median"]) for k in ("median", "min", "max")}
            row["intensity"] = fpt / bpt if fpt else None
        else:  # a prefill of `context` tokens reads the weights once and writes the KV cache
            row["intensity"] = fpt * ctx / (rec["weight_bytes"] + kv * ctx) if fpt else None
        row["flops_per_s"] = {k: fpt * st[k] for k in ("median", "min", "max")} if fpt else None
        rows.append(row)
    return rows


def _floors(a):
    """The artifact's A/A noise floors as a flat list (one per run, per arm or per record)."""
    f = a["doc"].get("noise_floor")
    vals = [f] if isinstance(f, (int, float)) else list(f.values()) if isinstance(f, dict) else []
    vals += [r["noise_floor"] for r in a["records"] if isinstance(r.get("noise_floor"), (int, float)) and r.get("noise_floor") != f]
    return [v for v in vals if isinstance(v, (int, float))]


def build_summary(loaded):
    arts = loaded["artifacts"]
    present = sorted({a["kind"] for a in arts})
    envs, ids = [], {}
    for a in arts:
        env = a["environment"]
        if not isinstance(env, dict) or "error" in env:
            a["env"] = None
            continue
        key = _env_key(env)
        if key not in ids:
            ids[key] = f"env{len(envs) + 1}"
            envs.append({"id": ids[key], "environment": env, "setup": numerics.key(env), "artifacts": []})
        a["env"] = ids[key]
        entry = envs[int(ids[key][3:]) - 1]
        entry["artifacts"].append(a["path"])
        load = env.get("loadavg") or a["doc"].get("loadavg_start")
        if load:
            entry.setdefault("loadavg_1min", []).append(load[0])

    warnings, notes = [], []
    by_blas, by_threads = {}, {}
    for a in arts:
        if a["env"]:
            env = a["environment"]
            by_blas.setdefault(f"{env.get('backend')}/{(env.get('blas') or {}).get('name')}", []).append(a["path"])
            by_threads.setdefault(numerics.key(env), []).append(a["path"])
        elif a["kind"] != "pack":
            warnings.append(f"{a['path']}: no environment recorded")
    if len(by_blas) > 1:
        warnings.append("artifacts come from different backend/BLAS setups ("
                        + "; ".join(f"{k}: {len(v)}" for k, v in sorted(by_blas.items()))
                        + " artifacts): compare figures only within one setup")
    elif len(by_threads) > 1:
        notes.append("BLAS thread counts differ between artifacts ("
                     + "; ".join(f"{k}: {len(v)}" for k, v in sorted(by_threads.items())) + " artifacts)")

    models = {}

    def slot(model, variant):
        return models.setdefault(model or "-", {}).setdefault(variant or "-", {})

    kernels = {"records": [], "comparisons": []}
    roofline, floors, bandwidth, extras = [], [], [], []
    for a in arts:
        kind, doc, env = a["kind"], a["doc"], a["env"]
        fl = _floors(a)
        if fl:
            floors.append({"path": a["path"], "kind": kind, "model": a["model"], **_summ(fl)})
        for key in ("copy_bandwidth",):
            src = doc.get(key) or (doc.get("roofline") or {}).get(key)
            if _is_stats(src):
                bandwidth.append({"path": a["path"], "kind": kind, "model": a["model"], **src})
        if kind in ("quantize", "pack", "validate"):
            slot(a["model"], a["variant"]).setdefault(kind, []).append({**a["info"], "environment": env})
        elif kind == "bench-kivi":
            kernels["records"] += [{**_scalars(r), **_stats(r), "environment": env} for r in a["records"] if _stats(r)]
            kernels["comparisons"] += [{**c, "environment": env} for c in a["comparisons"]]
            if _is_stats(doc.get("harness_overhead_s")):
                kernels.setdefault("harness_overhead_s", []).append({"path": a["path"], **doc["harness_overhead_s"]})
        elif kind.startswith("bench-"):
            section = {"bench-load": "load", "bench-quality": "quality"}.get(kind)
            for rec in a["records"]:
                st = _stats(rec)
                if st is None:
                    continue
                item = {**_scalars(rec), **{k: v for k, v in rec.items() if _is_stats(v)}, **st,
                        "noise_floor": rec.get("noise_floor", doc.get("noise_floor")), "environment": env,
                        "run": Path(a["path"]).name}
                variant = rec.get("variant") or rec.get("arm") or a["variant"]
                slot(rec.get("model") or a["model"], variant).setdefault(section or rec.get("phase", "decode"), []).append(item)
            for c in a["comparisons"]:
                slot(c.get("model") or a["model"], c.get("other_arm")).setdefault("comparisons", []).append(
                    {**c, "kind": kind, "environment": env, "run": Path(a["path"]).name})
            for t in a.get("timing", []):
                slot(a["model"], f"b{t.get('bits')}-{t.get('rotation')}").setdefault("quantize_timing", []).append(
                    {**t, "environment": env})
            if kind == "bench-decode":
                rows = _roofline_rows(a)
                roofline += rows
                for r in rows:
                    slot(r["model"], r["variant"]).setdefault("roofline", []).append(r)
            rest = {k: v for k, v in doc.items()
                    if k in ("targets", "checks", "copy_paths", "multiprocess", "throughput", "sizes", "lossless",
                             "amdahl", "skipped_arms")}
            if rest:
                extras.append({"path": a["path"], "run": Path(a["path"]).name, "kind": kind, "model": a["model"], **rest})
    return {
        "schema": 1,
        "inputs": [{"path": a["path"], "kind": a["kind"], "sha256": a["sha256"], "environment": a["env"]} for a in arts],
        "present": present,
        "missing": [k for k in KINDS if k not in present],
        "missing_paths": loaded["missing_paths"],
        "skipped": loaded["skipped"],
        "passed_over": loaded.get("passed_over", 0),
        "environments": envs,
        "warnings": warnings,
        "notes": notes,
        "noise_floors": floors,
        "copy_bandwidth": bandwidth,
        "models": models,
        "kernels": kernels,
        "roofline": roofline,
        "extras": extras,
        # Every artifact as read (minus the environment, see "environments", and per-layer state
        # metadata), so any figure not tabulated above is still here.
        "artifacts": [{"path": a["path"], "kind": a["kind"], "environment": a["env"],
                       "data": {k: v for k, v in a["doc"].items() if k not in _NOT_COPIED}} for a in arts],
    }


def _summ(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return {"n": len(xs), "median": xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2, "min": xs[0], "max": xs[-1]}


# --- plots -------------------------------------------------------------------------------------


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
    rl.plot(ax, bw["median"], fl["median"], points)
    ax.set_title(f"roofline of {Path(rows[0]['path']).name}: copy {bw['median'] / 1e9:.0f} GB/s, "
                 f"{fl.get('dtype') or ''} GEMM {fl['median'] / 1e12:.0f} TFLOP/s (medians)", fontsize=9)
    return _png(fig)


# --- rendering ---------------------------------------------------------------------------------


def _g(x, digits=4):
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _bytes(x):
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return "—"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _cells(st, scale=1.0, digits=4, fmt=None):
    """n, median, min–max of a summary (scaled, or formatted by ``fmt``)."""
    if not _is_stats(st):
        return ["—", "—", "—"]
    f = fmt or (lambda v: _g(v * scale, digits))
    return [str(st["n"]), f(st["median"]), f"{f(st['min'])}–{f(st['max'])}"]


def _med(st, fmt=_g):
    return fmt(st["median"]) if _is_stats(st) else "—"


def _pct(f):
    return "—" if not isinstance(f, (int, float)) else f"±{f:.1%}"


def _range(xs):
    return f"{min(xs):.2f}–{max(xs):.2f}" if xs else "—"


class _Doc:
    def __init__(self):
        self.blocks = []

    def h(self, level, text):
        self.blocks.append(("h", level, text))

    def p(self, text, warn=False):
        self.blocks.append(("p", text, warn))

    def table(self, headers, rows, empty="(none among the inputs)"):
        if rows:
            self.blocks.append(("table", headers, rows))
        else:
            self.p(empty)

    def img(self, name, png):
        self.blocks.append(("img", name, png))

    def markdown(self):
        out = []
        for b in self.blocks:
            if b[0] == "h":
                out.append("#" * b[1] + " " + b[2])
            elif b[0] == "p":
                out.append(("**Warning:** " if b[2] else "") + b[1])
            elif b[0] == "table":
                cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
                out.append("| " + " | ".join(map(cell, b[1])) + " |")
                out.append("|" + "---|" * len(b[1]))
                out += ["| " + " | ".join(map(cell, r)) + " |" for r in b[2]]
            elif b[0] == "img":
                out.append(f"![{b[1]}](plots/{b[1]}.png)")
            out.append("")
        return "\n".join(out)

    def html(self, title):
        e = html.escape
        out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
               "<style>body{font-family:sans-serif;max-width:1300px;margin:2em auto;padding:0 1em}"
               "table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.85em}"
               "th,td{border:1px solid #bbb;padding:0.2em 0.5em;text-align:left;vertical-align:top}"
               "th{background:#eee}img{max-width:100%}.warn{color:#a40;font-weight:bold}</style></head><body>"]
        for b in self.blocks:
            if b[0] == "h":
                out.append(f"<h{b[1]}>{e(b[2])}</h{b[1]}>")
            elif b[0] == "p":
                out.append(f'<p class="warn">Warning: {e(b[1])}</p>' if b[2] else f"<p>{e(b[1])}</p>")
            elif b[0] == "table":
                out.append("<table><thead><tr>" + "".join(f"<th>{e(str(h))}</th>" for h in b[1]) + "</tr></thead><tbody>")
                out += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in b[2]]
                out.append("</tbody></table>")
            elif b[0] == "img":
                out.append(f'<p><img alt="{e(b[1])}" src="data:image/png;base64,{base64.b64encode(b[2]).decode()}"></p>')
        out.append("</body></html>")
        return "\n".join(out)


_COMP_HEAD = ["baseline", "other", "n (baseline/other)", "speedup", "speedup min–max", "noise floor", "verdict"]


def _comparison_rows(comps, keys=()):
    rows = []
    for c in comps:
        b, o = c["baseline"], c["other"]
        verdict = c.get("verdict") or "—"
        rows.append([_g(c.get(k)) for k in keys] + [
            c.get("baseline_arm", "—"), c.get("other_arm", "—"), f"{b['n']}/{o['n']}", _g(c["speedup"]),
            f"{_g(b['min'] / o['max'])}–{_g(b['max'] / o['min'])}", _pct(c.get("floor")),
            verdict.split(" (")[0]])
    return rows


def _each(models, section):
    for m, vs in models.items():
        for v, d in vs.items():
            for r in d.get(section, []):
                yield m, v, r


def _stat_txt(st, scale=1.0, digits=4):
    """``median [min–max], n = N`` of a summary, in one cell."""
    if not _is_stats(st):
        return "—"
    f = lambda v: _g(v * scale, digits)  # noqa: E731
    return f"{f(st['median'])} [{f(st['min'])}–{f(st['max'])}], n = {st['n']}"


def _is_aa(c):
    return str(c.get("b", "")).endswith("(A/A)")


def _is_onoff(c):
    return "kernels on vs off" in str(c.get("what", "")) or (
        str(c.get("a", "")).endswith("kivi-ref") and str(c.get("b", "")).endswith("kivi-kernel"))


def _lossless_verdict(x):
    """yes / NO / not established, from ``lossless`` (``verdict`` or ``all_identical``) or else the checks."""
    ll = x.get("lossless") if isinstance(x.get("lossless"), dict) else {}
    onoff = [c for c in x.get("checks") or [] if isinstance(c, dict) and _is_onoff(c)]
    v = ll.get("verdict", ll.get("all_identical")) if ll else None
    if v is None and onoff and all(isinstance(c.get("identical"), bool) for c in onoff):
        v = all(c["identical"] for c in onoff)
    return {True: "yes", False: "NO", None: "not established (not run, or inconclusive)"}.get(v, str(v))


def _render_decode_extras(d, x):
    """bench-decode's skipped arms, output checks (lossless verdicts) and Amdahl prediction vs measurement."""
    run, model = x.get("run") or x["path"], x["model"]
    d.h(3, f"{run}: arms not run, output checks, Amdahl")
    if "skipped_arms" in x:
        sk = [s for s in x.get("skipped_arms") or [] if isinstance(s, dict)]
        d.table(["run", "model", "skipped arm", "reason"], [[run, model, s.get("arm"), s.get("reason")] for s in sk],
                empty=f"{run}: skipped arms: none (every arm ran).")
    checks = [c for c in x.get("checks") or [] if isinstance(c, dict)]
    aa = {c.get("context"): c.get("identical") for c in checks if _is_aa(c)}
    rows = []
    for c in checks:
        verdict = str(c.get("verdict"))
        if _is_onoff(c) and c.get("identical") is False and not c.get("conclusive") and aa.get(c.get("context")) is False:
            verdict += " (inconclusive: the baseline's A/A differed at this context)"
        ids = c.get("identical_ids")
        rows.append([run, model, _g(c.get("context")), c.get("a"), c.get("b"), c.get("what"),
                     _g(c.get("pairs")), "—" if ids is None else f"{ids}/{_g(c.get('pairs'))}",
                     _stat_txt(c.get("token_agreement")), _stat_txt(c.get("first_difference")), verdict])
    d.table(["run", "model", "context", "a", "b", "what", "prompts compared", "identical ids",
             "token agreement median [min–max], n", "first difference (token) median [min–max], n", "verdict"], rows,
            empty="(no output checks)")
    if "lossless" in x or any(_is_onoff(c) for c in checks):
        onoff = [c for c in checks if _is_onoff(c)]
        same = sum(1 for c in onoff if c.get("identical") is True)
        det = [f"P = {_g(k)}: {'identical' if v else 'DIFFERENT'}" for k, v in aa.items() if isinstance(v, bool)]
        d.p(f"{run}: {model}: kernels on vs off lossless: {_lossless_verdict(x)} ({same} of {len(onoff)} "
            f"kivi-ref/kivi-kernel pairs byte-identical"
            + (f"; baseline A/A determinism {', '.join(det)}" if det else "") + ").")
    am = [a for a in x.get("amdahl") or [] if isinstance(a, dict)]
    rows = []
    for a in am:
        for phase in ("decode", "prefill"):
            ph = a.get(phase) if isinstance(a.get(phase), dict) else None
            if ph is None:
                if a.get("reason"):
                    rows.append([run, a.get("weights") or "—", _g(a.get("context")), phase] + ["—"] * 11 + [a["reason"]])
                continue
            me = ph.get("measured") if isinstance(ph.get("measured"), dict) else {}
            sp, bound = me.get("speedup"), me.get("predicted_speedup_max_with_measured_reference")
            fl = me.get("floor") if isinstance(me.get("floor"), (int, float)) else 0.0
            within = "—" if not isinstance(sp, (int, float)) or not isinstance(bound, (int, float)) else (
                "yes" if sp <= bound else "above it, inside the noise floor" if sp <= bound * (1 + fl)
                else "NO (above it beyond the noise floor)")
            rows.append([run, a.get("weights") or "—", _g(a.get("context")), phase,
                         f"{_g(ph.get('launches_per_layer'))} × {_g(ph.get('layers'))}",
                         _g((ph.get("saving_s_per_token") or 0) * 1e6), _g(ph.get("predicted_speedup_max")),
                         *_cells(me.get("reference_s_per_token"), 1e3), *_cells(me.get("kernel_s_per_token"), 1e3),
                         _g(sp), _g(bound), _pct(me.get("floor")),
                         f"{me.get('verdict') or '—'}; within bound: {within}"])
    if am:
        d.p(f"{run}: Amdahl. Predicted (before timing, from bench-kivi's per-flush figures and the pilot's kivi-ref "
            "time): the saving per token and the bound on the speedup; measured: kivi-kernel vs kivi-ref per token "
            "(ms), the measured speedup and the bound recomputed with the measured reference time.")
    d.table(["run", "weights", "context", "phase", "flush launches × layers", "predicted saving (µs/token)",
             "predicted speedup ≤", "reference n", "median (ms/token)", "min–max", "kernel n", "median (ms/token)", "min–max",
             "measured speedup", "bound (measured T_ref)", "noise floor", "verdict"], rows,
            empty=f"{run}: no Amdahl prediction in this artifact.")



def _st(st, digits=4):
    """'median [min–max]' of a summary."""
    return f"{_g(st['median'], digits)} [{_g(st['min'], digits)}–{_g(st['max'], digits)}]" if _is_stats(st) else "—"


def _render_user_quality(d, summary):
    """bench-quality on real text: perplexity, KL, top-1 and bits per weight per arm; generations."""
    for a in summary["artifacts"]:
        x = a["data"]
        if a["kind"] != "bench-quality" or not isinstance(x.get("source"), dict):
            continue
        src, t = x["source"], x.get("text") or {}
        d.h(3, f"{x.get('model')}: quality on real text")
        d.p(f"{x.get('windows')} windows × {x.get('length')} tokens of {t.get('title')} ({t.get('author')}; "
            f"{t.get('license')}; {t.get('package')} {t.get('package_version')}), the eval split. "
            f"Source perplexity {_st(src.get('ppl'), 4)} (median [min–max] over windows). KL(source ‖ arm) and "
            "top-1 agreement are per token, averaged per window. bpw: stored bits of the quantized layers "
            "(codes + scales/biases/norms + codebooks + rotations) per weight; \"seed rot.\": with rotations "
            "stored as seeds (persist_rotation off).")
        if src.get("full_precision") is False:
            d.p(f"The source is not a full-precision model: {src.get('note')} (GGUF tensor types: "
                f"{src.get('gguf_types')}). Every figure is a distance to this dequantized model.", warn=True)
        rows = []
        for r in x.get("records") or []:
            if r.get("skipped"):
                rows.append([_g(r.get("bits")), r.get("method"), f"skipped: {r['skipped']}", "", "", "", "", ""])
                continue
            b = r.get("bpw") or {}
            rows.append([_g(r.get("bits")), r.get("method"), _g(b.get("bpw"), 4), _g(b.get("bpw_seed_rotation"), 4),
                         _st(r.get("ppl")), _st(r.get("kl")), _st(r.get("top1"), 3), _g(r.get("weight_rel_mse"), 4)])
        d.table(["bits", "arm", "bpw", "bpw (seed rot.)", "perplexity", "KL", "top-1", "weight rel. MSE"], rows)
        dense = ((x.get("records") or [{}])[0].get("bpw") or {}).get("unquantized_params")
        if dense:
            d.p("Kept unquantized in every arm (parameters): " + ", ".join(f"{k} {v:,}" for k, v in dense.items()) + ".")
        g = x.get("generations") or {}
        prompts = g.get("prompts") or []
        if prompts:
            d.p(f"Greedy generations ({g.get('max_tokens')} tokens, chat template) of the source and every arm:")
            d.table(["arm"] + [f"“{p}”" for p in prompts],
                    [[a.get("arm")] + list(a.get("texts") or []) for a in g.get("arms") or []])


def render(summary, plots):
    d = _Doc()
    models = summary["models"]
    d.h(1, "vqpipe report")
    d.p(f"Built from {len(summary['inputs'])} artifacts ({', '.join(summary['present']) or 'none'}). "
        f"Missing kinds: {', '.join(summary['missing']) or 'none'}."
        + (f" Input paths not found: {', '.join(summary['missing_paths'])}." if summary["missing_paths"] else "")
        + (f" Skipped files: {len(summary['skipped'])} (listed under Inputs)." if summary["skipped"] else "")
        + (f" {summary['passed_over']} other JSON files in the input directories are not artifacts."
           if summary.get("passed_over") else ""))
    d.p("Tables give n (samples), the median and the min–max range. A speedup is median(baseline time) / "
        "median(other time), shown with the A/A noise floor of the same run; inside the floor the verdict is "
        "\"no measurable difference\" (docs/benchmarking.md).")
    for w in summary["warnings"]:
        d.p(w, warn=True)
    for n in summary["notes"]:
        d.p(n)

    d.h(2, "Environment")
    rows = []
    for e in summary["environments"]:
        env, b = e["environment"], e["environment"].get("blas") or {}
        v = env.get("versions") or {}
        rows.append([e["id"], env.get("backend"), env.get("device"), env.get("cpu_model"), env.get("cpu_count"),
                     env.get("gpu_name") or "—", f"{b.get('name')} ({b.get('path')})", b.get("threads") or "—",
                     v.get("mlx"), v.get("mlx-lm"), v.get("numpy"), v.get("python"), env.get("platform"),
                     len(e["artifacts"]), _range(e.get("loadavg_1min"))])
    d.table(["id", "backend", "device", "CPU", "CPUs", "GPU", "BLAS", "BLAS threads", "mlx", "mlx-lm", "numpy", "python",
             "platform", "artifacts", "load avg (1 min) min–max"], rows)

    d.h(2, "Validate")
    rows = []
    for m, v, r in _each(models, "validate"):
        verdict = {True: "PASS (bit-exact)", False: "FAIL", None: "REFUSED"}.get(r.get("bit_exact"), "—")
        rows.append([m, v, r.get("persist_rotation") or "—", verdict, _g(r.get("n_prompts")), _g(r.get("max_abs_diff")),
                     _g(r.get("load_seconds")), r.get("environment") or "—", r.get("reason") or "—"])
    d.table(["model", "variant", "persist_rotation", "verdict", "prompts", "max |diff|", "load (s)", "environment", "reason"], rows)

    d.h(2, "Quantize")
    d.table(["model", "variant", "bits", "rotation", "dtype", "layers", "quantize (s)", "peak RSS", "layer rel. MSE n",
             "median", "min–max"],
            [[m, v, _g(r.get("bits")), _g(r.get("rotation")), _g(r.get("dtype")), _g(r.get("layers")),
              _g(r.get("quantize_seconds")), _bytes(r.get("peak_rss_bytes")), *_cells(r.get("layer_rel_mse"))]
             for m, v, r in _each(models, "quantize")])
    d.table(["model", "variant", "persist_rotation", "file size", "file / ideal payload", "pack (s)"],
            [[m, v, r.get("persist") or _g(r.get("persist_rotation")), _bytes(r.get("file_bytes")),
              _g(r.get("file_over_ideal")), _g(r.get("seconds"))] for m, v, r in _each(models, "pack")],
            empty="(no pack.json among the inputs: reservoir file sizes are in the load benchmark)")

    d.h(2, "Load time")
    rows = [[m, r.get("arm") or v, r.get("variant") or "—", *_cells(r), _bytes(r.get("file_bytes")),
             _med(r.get("mlx_peak_bytes"), _bytes), _med(r.get("rss_bytes"), _bytes), _pct(r.get("noise_floor"))]
            for m, v, r in _each(models, "load")]
    d.table(["model", "arm", "variant", "n", "median (s)", "min–max (s)", "file size", "MLX peak (median)",
             "RSS (median)", "noise floor"], rows)
    comps = [dict(c, model=m) for m, v, c in _each(models, "comparisons") if c.get("kind") == "bench-load"]
    d.table(["model"] + _COMP_HEAD, _comparison_rows(comps, ("model",)), empty="(no load comparisons)")
    d.img("load_time", plots["load_time"])
    for x in (x for x in summary["extras"] if x["kind"] == "bench-load"):
        if isinstance(x.get("targets"), dict):
            d.table(["model", "target", "value", "met"],
                    [[x["model"], k, _g(t.get("value")), {True: "met", False: "NOT met"}.get(t.get("met"), "reported")]
                     for k, t in x["targets"].items() if isinstance(t, dict)])
        if isinstance(x.get("checks"), dict):
            d.table(["model", "check", "result"], [[x["model"], k, _g(t)] for k, t in x["checks"].items()])
        paths = [c for c in x.get("copy_paths") or [] if isinstance(c, dict) and _is_stats(c)]
        d.table(["model", "copy path", "copies", "bytes", "n", "median (s)", "min–max (s)", "GB/s (median)"],
                [[x["model"], c.get("method"), _g(c.get("copies")), _bytes(c.get("bytes")), *_cells(c),
                  _g((c.get("bytes_per_s") or 0) / 1e9)] for c in paths], empty="(no copy-path figures)")
        mp = x.get("multiprocess")
        if isinstance(mp, dict):
            rows = []
            for what in ("reservoir_load", "requantize"):
                for k, st in (mp.get(what) or {}).items():
                    if _is_stats(st):
                        rows.append([x["model"], what, mp.get("procs"), k,
                                     *_cells(st, fmt=_bytes if k != "seconds" else None)])
            d.table(["model", "processes at once", "procs", "figure", "n", "median", "min–max"], rows)

    d.h(2, "Quality")
    _render_user_quality(d, summary)
    d.table(["model", "variant", "method", "bits", "metric", "n", "median", "min–max", "mean", "weight rel. MSE", "tokens"],
            [[m, v, r.get("method") or "—", _g(r.get("bits")), r.get("metric") or "—", *_cells(r, digits=5),
              _g(r.get("mean"), 5), _g(r.get("weight_rel_mse"), 5), _g(r.get("tokens"))]
             for m, v, r in _each(models, "quality")])
    rows = [[m, v, *_cells(r.get("seconds")), *_cells(r.get("peak_rss_bytes"), fmt=_bytes), _bytes(r.get("source_bytes"))]
            for m, v, r in _each(models, "quantize_timing")]
    if rows:
        d.table(["model", "variant", "quantize n", "median (s)", "min–max (s)", "peak RSS n", "median", "min–max",
                 "source size"], rows)

    d.h(2, "Decode and prefill")
    rows = []
    for m, vs in models.items():
        for v, dd in vs.items():
            for phase in ("decode", "prefill"):
                for r in sorted(dd.get(phase, []), key=lambda r: (str(r.get("run")), r.get("context") or 0)):
                    own = r.get("peak_over_start_bytes")
                    rows.append([r.get("run") or "—", m, r.get("arm") or v, r.get("precision") or "—", phase,
                                 _g(r.get("context")), *_cells(r), _bytes(own), _bytes(r.get("peak_memory_bytes")),
                                 _pct(r.get("noise_floor"))])
    d.table(["run", "model", "arm", "precision", "phase", "context", "n", "median (tok/s)", "min–max (tok/s)",
             "generation's own peak", "process peak", "noise floor"], rows)
    if rows:
        d.p("Peak memory is one pilot generation per arm (n = 1): \"generation's own peak\" is peak_over_start_bytes "
            "(mx.get_peak_memory() minus what was allocated before the generation), \"process peak\" is "
            "peak_memory_bytes (every model resident in the process included). The plot shows the generation's own "
            "peak where an artifact records it, the process peak otherwise (its axis label says which).")
    comps = [dict(c, model=m) for m, v, c in _each(models, "comparisons") if c.get("kind") == "bench-decode"]
    comps.sort(key=lambda c: (str(c.get("run")), c.get("context") or 0, str(c.get("phase"))))
    d.table(["run", "model", "phase", "context"] + _COMP_HEAD, _comparison_rows(comps, ("run", "model", "phase", "context")),
            empty="(no decode comparisons)")
    d.img("decode_context", plots["decode_context"])
    for x in (x for x in summary["extras"] if x["kind"] == "bench-decode"):
        _render_decode_extras(d, x)

    d.h(2, "Kernels (KIVI)")
    k = summary["kernels"]
    comps = sorted(k["comparisons"], key=lambda c: (str(c.get("op")), str(c.get("mode")), c.get("S") or 0))
    if comps:
        d.p("Per flush, kernel against the MLX-ops reference, interleaved in one process. ratio = median(kernel) / "
            "median(reference); speedup = its inverse; the floor is the larger of the two arms' A/A floors. GB/s: the "
            "fewest bytes one launch must move over the kernel's median time, and its share of the copy bandwidth "
            "measured in the same run.")
        rows = []
        for c in comps:
            b, o = c["baseline"], c["other"]
            bps = c.get("kernel_bytes_per_s")
            rows.append([c.get("op") or "—", c.get("mode") or "—", _g(c.get("S")), *_cells(b, 1e6), *_cells(o, 1e6),
                         _g(c.get("ratio")), _g(c["speedup"]), f"{_g(b['min'] / o['max'])}–{_g(b['max'] / o['min'])}",
                         _pct(c.get("floor")), (c.get("verdict") or "—").split(" (")[0],
                         _g(bps / 1e9) if isinstance(bps, (int, float)) else "—",
                         _pct(c.get("fraction_of_copy_bandwidth")).lstrip("±"), _g(c.get("outputs_equal")),
                         "—" if c.get("m4_speedup") is None else f"{_g(c['m4_speedup'])} ({'beaten' if c.get('beats_m4') else 'not beaten'})"])
        d.table(["op", "mode", "S", "reference n", "median (µs)", "min–max (µs)", "kernel n", "median (µs)",
                 "min–max (µs)", "ratio kernel/ref", "speedup", "speedup min–max", "noise floor", "verdict",
                 "kernel GB/s (median)", "of copy bandwidth", "outputs equal", "M4 speedup (KIVI issue)"], rows)
    else:
        d.table(["op", "mode", "arm", "S", "n", "median (µs)", "min–max (µs)", "noise floor"],
                [[r.get("op") or "—", r.get("mode") or "—", r.get("arm") or "—", _g(r.get("S")), *_cells(r, 1e6),
                  _pct(r.get("noise_floor"))] for r in k["records"] if not str(r.get("arm", "")).endswith("(A/A)")],
                empty="(no bench-kivi artifact)")
        if k["records"]:
            d.p("No kernel arm ran (no Metal/CUDA backend where the artifact was made): reference timings only.")
    ov = k.get("harness_overhead_s") or []
    if ov:
        d.table(["artifact", "empty timed call n", "median (µs)", "min–max (µs)"],
                [[o["path"], *_cells(o, 1e6)] for o in ov])
    d.img("kernel_speedup", plots["kernel_speedup"])

    d.h(2, "Roofline")
    d.table(["artifact", "kind", "copy bandwidth n", "median (GB/s)", "min–max (GB/s)", "method", "buffer"],
            [[b["path"], b["kind"], *_cells(b, 1e-9), b.get("method") or "—", _bytes(b.get("bytes"))]
             for b in summary["copy_bandwidth"]], empty="(no copy-bandwidth measurement among the inputs)")
    peaks = {r["path"]: r["peak_flops"] for r in summary["roofline"] if r.get("peak_flops")}
    d.table(["artifact", "fp32 GEMM n", "median (GFLOP/s)", "min–max (GFLOP/s)"],
            [[p, *_cells(f, 1e-9)] for p, f in peaks.items()], empty="(no GEMM roof: no bench-decode artifact)")
    rows = []
    for r in (r for r in summary["roofline"] if r["phase"] == "decode"):
        a = r["achieved"]
        ctx = _g(r["context"]) + (f" (mean {_g(r['mean_context'])})" if r.get("mean_context") else "")
        rows.append([r["model"], r["precision"], ctx, _bytes(r["bytes_per_token"]), *_cells(r["tok_s"]),
                     _g(a["median"]["bytes_per_s"] / 1e9), f"{a['median']['percent_of_peak']:.1f}%",
                     f"{a['min']['percent_of_peak']:.1f}–{a['max']['percent_of_peak']:.1f}%"])
    d.table(["model", "precision", "context", "bytes/token", "n", "median tok/s", "min–max tok/s", "achieved GB/s (median)",
             "% of copy bandwidth (median)", "min–max"], rows,
            empty="(no achieved-bandwidth figures: no bench-decode artifact)")
    d.img("roofline", plots["roofline"])

    d.h(2, "Noise floors")
    d.table(["artifact", "kind", "model", "floors n", "median", "min–max"],
            [[f["path"], f["kind"], f.get("model") or "—", *_cells(f, fmt=lambda v: f"±{v:.1%}")] for f in summary["noise_floors"]])

    d.h(2, "Inputs")
    d.table(["path", "kind", "environment", "sha256 / reason"],
            [[i["path"], i["kind"], i["environment"] or "—", i["sha256"][:16]] for i in summary["inputs"]]
            + [[s["path"], "skipped", "—", s["reason"]] for s in summary["skipped"]])
    return d


def make_report(inputs, out_dir):
    out_dir = Path(out_dir)
    summary = build_summary(load_artifacts(inputs))
    plots = {"load_time": plot_load(summary), "decode_context": plot_decode(summary),
             "kernel_speedup": plot_kernels(summary), "roofline": plot_roofline(summary)}
    for name, png in plots.items():
        write_bytes(out_dir / "plots" / f"{name}.png", png)
    doc = render(summary, plots)
    write_bytes(out_dir / "report.md", doc.markdown())
    write_bytes(out_dir / "index.html", doc.html("vqpipe report"))
    write_bytes(out_dir / "summary.json", json.dumps(summary, indent=1, default=str))
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe report", description="Aggregate artifacts into the report.")
    p.add_argument("--inputs", nargs="+", required=True, help="JSON artifacts or directories holding them")
    p.add_argument("--out", default="results/report", help="output directory (default: results/report)")
    args = p.parse_args(argv)
    from .manifest import ManifestError, verify

    try:  # artifacts (quantized.json, pack.json) of a shared cache are checked before they are read
        for d in sorted({Path(i).parent for i in args.inputs if Path(i).is_file()}):
            verify(d)
    except ManifestError as e:
        print(f"vqpipe report: error: {e}", file=sys.stderr)
        return 2
    summary = make_report(args.inputs, args.out)
    print(f"report: {len(summary['inputs'])} artifacts -> {args.out}/index.html"
          + (f"; missing: {', '.join(summary['missing'])}" if summary["missing"] else ""))
    for w in summary["warnings"]:
        print(f"report: warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
