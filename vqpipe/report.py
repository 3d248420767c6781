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
import os
import sys
from pathlib import Path

from . import blas
from .bench import roofline as rl

KINDS = ("quantize", "validate", "bench-load", "bench-decode", "bench-kivi", "bench-quality")
PLOTS = ("load_time", "decode_context", "kernel_speedup", "roofline")
OUTPUTS = ("index.html", "report.md", "summary.json") + tuple(f"plots/{p}.png" for p in PLOTS)
_STAT_KEYS = ("n", "median", "min", "max")


def write_atomic(path, data):
    """Write bytes (or str) to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- loading ---------------------------------------------------------------------------------


def _kind_of(path, doc):
    if not isinstance(doc, dict):
        return None
    if doc.get("kind"):
        return doc["kind"]
    if path.name == "quantized.json":
        return "quantize"
    if "bit_exact" in doc:
        return "validate"
    return None


def load_artifacts(paths):
    """Read JSON files (directories are searched recursively) -> ``{"artifacts", "missing_paths", "skipped"}``."""
    files, missing_paths, skipped, arts = [], [], [], []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            missing_paths.append(str(p))
    for f in dict.fromkeys(files):
        raw = f.read_bytes()
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            skipped.append({"path": str(f), "reason": f"not JSON: {e}"})
            continue
        kind = _kind_of(f, doc)
        if kind is None:
            skipped.append({"path": str(f), "reason": "no 'kind' (not a vqpipe artifact)"})
            continue
        arts.append({"path": str(f), "kind": kind, "doc": doc, "sha256": hashlib.sha256(raw).hexdigest()})
    return {"artifacts": arts, "missing_paths": missing_paths, "skipped": skipped}


def _stats(rec):
    """A record's (n, median, min, max); a bare ``value`` is one observation."""
    if all(k in rec for k in _STAT_KEYS):
        return {k: rec[k] for k in _STAT_KEYS}
    if "value" in rec and isinstance(rec["value"], (int, float)):
        v = rec["value"]
        return {"n": rec.get("n", 1), "median": v, "min": v, "max": v}
    return None


def _items(doc, key):
    """A list of dict entries under ``key``; anything else is ignored rather than fatal."""
    items = doc.get(key)
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def _comparison(c):
    return all(isinstance(c.get(k), dict) and all(s in c[k] for s in _STAT_KEYS) for k in ("baseline", "other")) and "speedup" in c


def _scalars(doc, drop=()):
    return {k: v for k, v in doc.items() if k not in drop and (v is None or isinstance(v, (str, int, float, bool)))}


# --- summary ---------------------------------------------------------------------------------


def _env_key(env):
    return json.dumps({k: v for k, v in env.items() if k not in ("device_info", "loadavg")}, sort_keys=True, default=str)


def _variant(rec, doc):
    return rec.get("variant") or rec.get("arm") or doc.get("variant") or "-"


def _roofline_rows(doc):
    roof = doc.get("roofline") or {}
    bw, fl = roof.get("copy_bandwidth"), roof.get("matmul_flops")
    if not (isinstance(bw, dict) and bw.get("median")):
        return []
    n_params = roof.get("matmul_params")
    rows = []
    for rec in _items(doc, "records"):
        st = _stats(rec)
        if st is None or rec.get("phase") not in ("decode", "prefill") or "weight_bytes" not in rec:
            continue
        ctx = rec.get("context", 0)
        kv = rec.get("kv_bytes_per_position", 0)
        bpt = rec.get("bytes_per_token") or rl.decode_bytes_per_token(rec["weight_bytes"], kv, ctx)
        fpt = rec.get("flops_per_token") or (rl.flops_per_token(n_params) if n_params else None)
        row = {
            "model": rec.get("model") or doc.get("model"),
            "arm": rec.get("arm"),
            "precision": rec.get("precision") or rec.get("arm"),
            "phase": rec["phase"],
            "context": ctx,
            "tok_s": st,
            "peak_bandwidth": bw,
            "peak_flops": fl,
        }
        if rec["phase"] == "decode":
            row["bytes_per_token"] = bpt
            row["achieved"] = {k: rl.achieved(bpt, st[k], bw["median"]) for k in ("median", "min", "max")}
            row["intensity"] = fpt / bpt if fpt else None
        else:  # a prefill of `context` tokens reads the weights once and writes the KV cache
            total_bytes = rec["weight_bytes"] + kv * ctx
            row["intensity"] = fpt * ctx / total_bytes if fpt else None
        row["flops_per_s"] = {k: fpt * st[k] for k in ("median", "min", "max")} if fpt else None
        rows.append(row)
    return rows


def build_summary(loaded):
    arts = loaded["artifacts"]
    present = sorted({a["kind"] for a in arts})
    envs, env_ids = [], {}
    for a in arts:
        env = a["doc"].get("environment")
        if isinstance(env, dict):
            key = _env_key(env)
            if key not in env_ids:
                env_ids[key] = f"env{len(envs) + 1}"
                envs.append({"id": env_ids[key], "environment": env, "artifacts": []})
            a["env"] = env_ids[key]
            entry = next(e for e in envs if e["id"] == a["env"])
            entry["artifacts"].append(a["path"])
            if env.get("loadavg"):
                entry.setdefault("loadavg_1min", []).append(env["loadavg"][0])
    warnings = []
    setups = {}
    for a in arts:
        env = a["doc"].get("environment")
        if isinstance(env, dict):
            setups.setdefault(blas.setup_key(env), []).append(a["path"])
    if len(setups) > 1:
        warnings.append(
            "artifacts come from different backend/BLAS setups ("
            + "; ".join(f"{k}: {len(v)} artifacts" for k, v in sorted(setups.items()))
            + "): compare figures only within one setup"
        )
    for a in arts:
        if a["kind"] != "quantize" and not isinstance(a["doc"].get("environment"), dict):
            warnings.append(f"{a['path']}: no environment recorded")

    models = {}

    def slot(model, variant):
        return models.setdefault(model or "-", {}).setdefault(variant or "-", {})

    kernels = {"records": [], "comparisons": [], "noise_floors": []}
    roofline, floors = [], []
    for a in arts:
        doc, kind = a["doc"], a["kind"]
        if "noise_floor" in doc:
            floors.append({"path": a["path"], "kind": kind, "model": doc.get("model"), "noise_floor": doc["noise_floor"]})
        if kind == "quantize":
            slot(doc.get("model"), doc.get("variant"))["quantize"] = {**_scalars(doc), "environment": a.get("env")}
        elif kind == "validate":
            entry = _scalars(doc, drop=("kind",))
            entry["environment"] = a.get("env")
            entry["blas"] = doc.get("blas") or ((doc.get("environment") or {}).get("blas") or {}).get("name")
            slot(doc.get("model"), doc.get("variant")).setdefault("validate", []).append(entry)
        elif kind in ("bench-load", "bench-quality", "bench-decode"):
            for rec in _items(doc, "records"):
                st = _stats(rec)
                if st is None:
                    continue
                key = {"bench-load": "load", "bench-quality": "quality"}.get(kind) or rec.get("phase", "decode")
                item = {**_scalars(rec), **st, "noise_floor": rec.get("noise_floor", doc.get("noise_floor")), "environment": a.get("env")}
                slot(rec.get("model") or doc.get("model"), _variant(rec, doc)).setdefault(key, []).append(item)
            for c in filter(_comparison, _items(doc, "comparisons")):
                m = c.get("model") or doc.get("model")
                slot(m, c.get("other_arm")).setdefault("comparisons", []).append({**c, "kind": kind})
            if kind == "bench-decode":
                rows = _roofline_rows(doc)
                roofline += rows
                for r in rows:
                    slot(r["model"], _variant(r, doc)).setdefault("roofline", []).append(r)
        elif kind == "bench-kivi":
            kernels["records"] += [{**_scalars(r), **_stats(r), "environment": a.get("env")} for r in _items(doc, "records") if _stats(r)]
            kernels["comparisons"] += [{**c, "environment": a.get("env")} for c in _items(doc, "comparisons") if _comparison(c)]
            if "noise_floor" in doc:
                kernels["noise_floors"].append(doc["noise_floor"])
    return {
        "schema": 1,
        "inputs": [{"path": a["path"], "kind": a["kind"], "sha256": a["sha256"], "environment": a.get("env")} for a in arts],
        "present": present,
        "missing": [k for k in KINDS if k not in present],
        "missing_paths": loaded["missing_paths"],
        "skipped": loaded["skipped"],
        "environments": envs,
        "warnings": warnings,
        "noise_floors": floors,
        "models": models,
        "kernels": kernels,
        "roofline": roofline,
    }


# --- plots -----------------------------------------------------------------------------------


def _figure(ncols=1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.2), squeeze=False)
    return fig, list(axes[0])


def _png(fig):
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _no_data(title, why):
    fig, (ax,) = _figure()
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
    ax.set_axis_off()
    ax.set_title(title)
    return _png(fig)


def _errbar(st, scale=1.0):
    return [[(st["median"] - st["min"]) * scale], [(st["max"] - st["median"]) * scale]]


def plot_load(summary):
    rows = [(m, v, r) for m, vs in summary["models"].items() for v, d in vs.items() for r in d.get("load", [])]
    if not rows:
        return _no_data("load time", "no bench-load artifact among the inputs")
    fig, (ax,) = _figure()
    fig.set_figheight(max(3.0, 0.35 * len(rows) + 1.5))
    labels = [f"{m} / {r.get('arm') or v}" + (f" {r['variant']}" if r.get("variant") else "") for m, v, r in rows]
    for y, (_, _, r) in enumerate(rows):
        ax.barh(y, r["median"], xerr=_errbar(r), color="C0", capsize=3)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("load time (s), median with min-max")
    ax.set_title(f"load time per variant (n={','.join(sorted({str(r['n']) for _, _, r in rows}))})")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return _png(fig)


def plot_decode(summary):
    series = {}
    for m, vs in summary["models"].items():
        for v, d in vs.items():
            for r in d.get("decode", []):
                if "context" in r:
                    series.setdefault(f"{m} / {r.get('arm') or v}", []).append(r)
    if not series:
        return _no_data("decode vs context", "no bench-decode artifact with decode records among the inputs")
    fig, (a1, a2) = _figure(2)
    for label, recs in series.items():
        recs = sorted(recs, key=lambda r: r["context"])
        x = [r["context"] for r in recs]
        a1.errorbar(
            x, [r["median"] for r in recs],
            yerr=[[r["median"] - r["min"] for r in recs], [r["max"] - r["median"] for r in recs]],
            marker="o", capsize=3, label=label,
        )
        mem = [(r["context"], r["peak_memory_bytes"] / 2**20) for r in recs if r.get("peak_memory_bytes")]
        if mem:
            a2.plot(*zip(*mem), marker="o", label=label)
    a1.set_xlabel("context length (tokens)")
    a1.set_ylabel("decode tok/s (median, min-max)")
    a1.set_title("decode throughput")
    a2.set_xlabel("context length (tokens)")
    a2.set_ylabel("peak memory (MiB)")
    a2.set_title("peak memory (mx.get_peak_memory)")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


def plot_kernels(summary):
    comps = [c for c in summary["kernels"]["comparisons"] if "S" in c and "speedup" in c]
    if not comps:
        return _no_data("kernel speedup", "no bench-kivi artifact with comparisons among the inputs")
    fig, (ax,) = _figure()
    groups = {}
    for c in comps:
        groups.setdefault(f"{c.get('op', '?')}: {c.get('other_arm')} vs {c.get('baseline_arm')}", []).append(c)
    for label, cs in groups.items():
        cs = sorted(cs, key=lambda c: c["S"])
        x = [c["S"] for c in cs]
        y = [c["speedup"] for c in cs]
        lo = [c["baseline"]["min"] / c["other"]["max"] for c in cs]
        hi = [c["baseline"]["max"] / c["other"]["min"] for c in cs]
        line = ax.errorbar(x, y, yerr=[[b - a for a, b in zip(lo, y)], [b - a for a, b in zip(y, hi)]], marker="o", capsize=3, label=label)
        f = [c.get("floor", 0.0) for c in cs]
        ax.fill_between(x, [1 / (1 + v) for v in f], [1 + v for v in f], color=line[0].get_color(), alpha=0.12)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (sequence length)")
    ax.set_ylabel("speedup (median; bars: min-max; band: noise floor)")
    ax.set_title("kernel speedup against S")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def plot_roofline(summary):
    rows = [r for r in summary["roofline"] if r.get("intensity") and r.get("flops_per_s") and r.get("peak_flops")]
    if not rows:
        return _no_data("roofline", "no bench-decode artifact with roofline figures among the inputs")
    fig, (ax,) = _figure()
    fig.set_figwidth(10)
    points = [
        {
            "label": f"{r['model']} {r['precision']} {r['phase']} @{r['context']}",
            "intensity": r["intensity"],
            "flops_per_s": r["flops_per_s"]["median"],
            "phase": r["phase"],
        }
        for r in rows
    ]
    rl.plot(ax, rows[0]["peak_bandwidth"]["median"], rows[0]["peak_flops"]["median"], points)
    return _png(fig)


# --- rendering -------------------------------------------------------------------------------


def _g(x, digits=4):
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _bytes(x):
    if x is None:
        return "—"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x} B"


def _stat_cells(st, scale=1.0, digits=4):
    if not st:
        return ["—", "—", "—"]
    return [str(st["n"]), _g(st["median"] * scale, digits), f"{_g(st['min'] * scale, digits)}–{_g(st['max'] * scale, digits)}"]


def _range(xs):
    return f"{min(xs):.2f}–{max(xs):.2f}" if xs else "—"


def _floor(f):
    return "—" if f is None else f"±{f:.1%}"


class _Doc:
    def __init__(self):
        self.blocks = []

    def h(self, level, text):
        self.blocks.append(("h", level, text))

    def p(self, text):
        self.blocks.append(("p", text))

    def table(self, headers, rows):
        if rows:
            self.blocks.append(("table", headers, rows))
        else:
            self.p("(no rows)")

    def img(self, name, png):
        self.blocks.append(("img", name, png))

    def markdown(self):
        out = []
        for b in self.blocks:
            if b[0] == "h":
                out.append("#" * b[1] + " " + b[2])
            elif b[0] == "p":
                out.append(b[1])
            elif b[0] == "table":
                cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
                out.append("| " + " | ".join(map(cell, b[1])) + " |")
                out.append("|" + "---|" * len(b[1]))
                out += ["| " + " | ".join(map(cell, r)) + " |" for r in b[2]]
            elif b[0] == "img":
                out.append(f"![{b[1]}](plots/{b[1]}.png)")
            out.append("")
        return "\n".join(out)

    def html(self, title):
        e = html.escape
        out = [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{e(title)}</title>",
            "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
            "table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.9em}"
            "th,td{border:1px solid #bbb;padding:0.25em 0.6em;text-align:left}th{background:#eee}"
            "img{max-width:100%}.warn{color:#a40}</style></head><body>",
        ]
        for b in self.blocks:
            if b[0] == "h":
                out.append(f"<h{b[1]}>{e(b[2])}</h{b[1]}>")
            elif b[0] == "p":
                cls = ' class="warn"' if b[1].startswith("**Warning") else ""
                out.append(f"<p{cls}>{e(b[1].replace('**', ''))}</p>")
            elif b[0] == "table":
                out.append("<table><thead><tr>" + "".join(f"<th>{e(str(h))}</th>" for h in b[1]) + "</tr></thead><tbody>")
                out += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in b[2]]
                out.append("</tbody></table>")
            elif b[0] == "img":
                data = base64.b64encode(b[2]).decode()
                out.append(f'<p><img alt="{e(b[1])}" src="data:image/png;base64,{data}"></p>')
        out.append("</body></html>")
        return "\n".join(out)


def _comparison_rows(comps, extra=()):
    rows = []
    for c in comps:
        rows.append(
            [_g(c.get(k)) for k in extra]
            + [c.get("baseline_arm", "—"), c.get("other_arm", "—"), str(c["baseline"]["n"]), _g(c["speedup"]),
               _g(c["baseline"]["min"] / c["other"]["max"]) + "–" + _g(c["baseline"]["max"] / c["other"]["min"]),
               _floor(c.get("floor")), c.get("verdict", "—")]
        )
    return rows


_COMP_HEAD = ["baseline", "other", "n", "speedup (median ratio)", "min–max", "noise floor", "verdict"]


def render(summary, plots):
    d = _Doc()
    d.h(1, "vqpipe report")
    d.p(
        f"Built from {len(summary['inputs'])} artifacts ({', '.join(summary['present']) or 'none'}). "
        f"Missing kinds: {', '.join(summary['missing']) or 'none'}."
        + (f" Input paths not found: {', '.join(summary['missing_paths'])}." if summary["missing_paths"] else "")
        + (f" Skipped files: {len(summary['skipped'])}." if summary["skipped"] else "")
    )
    d.p("Every table gives n (samples), the median and the min–max range; speedups are "
        "median(baseline time) / median(other time), shown with the A/A noise floor of the same run "
        "(docs/benchmarking.md).")
    for w in summary["warnings"]:
        d.p(f"**Warning:** {w}")

    d.h(2, "Environment")
    rows = []
    for e in summary["environments"]:
        env = e["environment"]
        b = env.get("blas") or {}
        v = env.get("versions") or {}
        blas = f"{b.get('name')} ({b.get('path')})" + (f", {b['threads']} threads" if b.get("threads") else "")
        rows.append([e["id"], env.get("backend"), env.get("device"), env.get("cpu_model"), env.get("gpu_name") or "—",
                     blas, v.get("mlx"), v.get("mlx-lm"), v.get("numpy"), v.get("python"), env.get("platform"),
                     len(e["artifacts"]), _range(e.get("loadavg_1min"))])
    d.table(["id", "backend", "device", "CPU", "GPU", "BLAS", "mlx", "mlx-lm", "numpy", "python", "platform", "artifacts",
             "load avg (1 min) min–max"], rows)

    models = summary["models"]
    d.h(2, "Validate")
    rows = []
    for m, vs in models.items():
        for v, dd in vs.items():
            for r in dd.get("validate", []):
                rows.append([m, v, _g(r.get("persist_rotation")), "PASS (bit-exact)" if r.get("bit_exact") else "FAIL",
                             _g(r.get("max_abs_diff")), r.get("backend") or "—", r.get("blas") or "—"])
    d.table(["model", "variant", "persist_rotation", "verdict", "max |diff|", "backend", "BLAS"], rows)

    d.h(2, "Quantize")
    qs = [(m, v, dd["quantize"]) for m, vs in models.items() for v, dd in vs.items() if "quantize" in dd]
    keys = sorted({k for _, _, q in qs for k in q} - {"model", "variant", "kind"})
    d.table(["model", "variant"] + keys, [[m, v] + [_bytes(q.get(k)) if k.endswith("bytes") else _g(q.get(k)) for k in keys] for m, v, q in qs])

    d.h(2, "Load time")
    rows, comps = [], []
    for m, vs in models.items():
        for v, dd in vs.items():
            for r in dd.get("load", []):
                rows.append([m, r.get("arm") or v, r.get("variant") or "—", *_stat_cells(r), _bytes(r.get("file_bytes")), _floor(r.get("noise_floor"))])
            comps += [dict(c, model=m) for c in dd.get("comparisons", []) if c.get("kind") == "bench-load"]
    d.table(["model", "arm", "variant", "n", "median (s)", "min–max (s)", "file size", "noise floor"], rows)
    d.table(["model"] + _COMP_HEAD, _comparison_rows(comps, ("model",)))
    d.img("load_time", plots["load_time"])

    d.h(2, "Quality")
    rows = []
    for m, vs in models.items():
        for v, dd in vs.items():
            for r in dd.get("quality", []):
                rows.append([m, v, r.get("metric", "—"), r.get("dataset", "—"), *_stat_cells(r, digits=6)])
    d.table(["model", "variant / arm", "metric", "dataset", "n", "median", "min–max"], rows)

    d.h(2, "Decode and prefill")
    rows, comps = [], []
    for m, vs in models.items():
        for v, dd in vs.items():
            for phase in ("decode", "prefill"):
                for r in sorted(dd.get(phase, []), key=lambda r: r.get("context", 0)):
                    rows.append([m, r.get("arm") or v, r.get("precision", "—"), phase, _g(r.get("context")), *_stat_cells(r),
                                 _bytes(r.get("peak_memory_bytes")), _floor(r.get("noise_floor"))])
            comps += [dict(c, model=m) for c in dd.get("comparisons", []) if c.get("kind") == "bench-decode"]
    d.table(["model", "arm", "precision", "phase", "context", "n", "median (tok/s)", "min–max (tok/s)", "peak memory", "noise floor"], rows)
    d.table(["model", "phase", "context"] + _COMP_HEAD, _comparison_rows(comps, ("model", "phase", "context")))
    d.img("decode_context", plots["decode_context"])

    d.h(2, "Kernels (KIVI)")
    k = summary["kernels"]
    d.table(["op", "arm", "S", "n", "median (ms)", "min–max (ms)"],
            [[r.get("op", "—"), r.get("arm", "—"), _g(r.get("S")), *_stat_cells(r, 1e3)] for r in k["records"]])
    d.table(["op", "S"] + _COMP_HEAD, _comparison_rows(sorted(k["comparisons"], key=lambda c: (c.get("op", ""), c.get("S", 0))), ("op", "S")))
    d.img("kernel_speedup", plots["kernel_speedup"])

    d.h(2, "Roofline")
    peaks = {}
    for r in summary["roofline"]:
        peaks[r["model"]] = (r["peak_bandwidth"], r["peak_flops"])
    d.table(["model", "copy bandwidth n", "median (GB/s)", "min–max (GB/s)", "fp32 GEMM n", "median (GFLOP/s)", "min–max (GFLOP/s)"],
            [[m, *_stat_cells(bw, 1e-9), *_stat_cells(fl, 1e-9)] for m, (bw, fl) in peaks.items()])
    rows = []
    for r in summary["roofline"]:
        if r["phase"] != "decode":
            continue
        a = r["achieved"]
        rows.append([r["model"], r["precision"], _g(r["context"]), _bytes(r["bytes_per_token"]), *_stat_cells(r["tok_s"]),
                     _g(a["median"]["bytes_per_s"] / 1e9), f"{a['median']['percent_of_peak']:.1f}%",
                     f"{a['min']['percent_of_peak']:.1f}–{a['max']['percent_of_peak']:.1f}%"])
    d.table(["model", "precision", "context", "bytes/token", "n", "median tok/s", "min–max tok/s", "achieved GB/s (median)",
             "% of peak (median)", "% of peak (min–max)"], rows)
    d.img("roofline", plots["roofline"])

    d.h(2, "Noise floors")
    d.table(["artifact", "kind", "model", "A/A noise floor"],
            [[f["path"], f["kind"], f.get("model") or "—", _floor(f["noise_floor"])] for f in summary["noise_floors"]])

    d.h(2, "Inputs")
    d.table(["path", "kind", "environment", "sha256"],
            [[i["path"], i["kind"], i["environment"] or "—", i["sha256"][:16]] for i in summary["inputs"]]
            + [[s["path"], "skipped", "—", s["reason"]] for s in summary["skipped"]])
    return d


def make_report(inputs, out_dir):
    out_dir = Path(out_dir)
    summary = build_summary(load_artifacts(inputs))
    plots = {
        "load_time": plot_load(summary),
        "decode_context": plot_decode(summary),
        "kernel_speedup": plot_kernels(summary),
        "roofline": plot_roofline(summary),
    }
    for name, png in plots.items():
        write_atomic(out_dir / "plots" / f"{name}.png", png)
    doc = render(summary, plots)
    write_atomic(out_dir / "report.md", doc.markdown())
    write_atomic(out_dir / "index.html", doc.html("vqpipe report"))
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=1, default=str))
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe report", description="Aggregate artifacts into the report.")
    p.add_argument("--inputs", nargs="+", required=True, help="JSON artifacts or directories holding them")
    p.add_argument("--out", default="results/report", help="output directory (default: results/report)")
    args = p.parse_args(argv)
    summary = make_report(args.inputs, args.out)
    print(f"report: {len(summary['inputs'])} artifacts -> {args.out}/index.html"
          + (f"; missing: {', '.join(summary['missing'])}" if summary["missing"] else ""))
    for w in summary["warnings"]:
        print(f"report: warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
