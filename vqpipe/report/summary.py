"""The report's summary: artifact records (vqpipe/store/record.py) -> one dict of every figure, by model.

Pure: reads JSON, checks each record against workflow/schemas/record.schema.json (a malformed one
stops the report, naming the file and the field) and arranges what the tables and plots show. No
MLX import, so a report can be built on any machine from copied records.
"""

import hashlib
import json
from pathlib import Path

from .. import numerics
from ..store import record

KINDS = ("quantize", "pack", "validate", "bench-load", "bench-decode", "bench-kivi", "bench-kv-quality", "bench-quality")
STAT_KEYS = ("n", "median", "min", "max")
# Copied into summary["artifacts"] minus these: the environment (see "environments") and per-layer state.
_NOT_COPIED = ("environment", "reference_environment", "layers")
# bench-quality's methods, as pipeline variants (quality.py: rotated = rotation auto, unrotated = none).
_QUALITY_VARIANT = {"rotated": "b{bits}-auto", "unrotated": "b{bits}-none", "affine": "mlx-affine-b{bits}",
                    "vqpipe": "b{bits}-{rotation}", "affine-g32": "mlx-affine-b{bits}-g32",
                    "affine-g64": "mlx-affine-b{bits}-g64", "affine-g128": "mlx-affine-b{bits}-g128"}
# Payload parts that are not per-arm records; shown per artifact.
_EXTRAS = ("targets", "checks", "copy_paths", "multiprocess", "throughput", "sizes", "lossless", "amdahl",
           "skipped_arms")


def is_stats(x):
    return isinstance(x, dict) and all(k in x for k in STAT_KEYS)


def stats(x):
    return {k: x[k] for k in STAT_KEYS}


def summarize(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return {"n": len(xs), "median": xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2, "min": xs[0], "max": xs[-1]}


def scalars(doc, drop=()):
    return {k: v for k, v in doc.items() if k not in drop and (v is None or isinstance(v, (str, int, float, bool)))}


# --- reading -----------------------------------------------------------------------------------


def _files(paths):
    """{file: named explicitly}; directories are searched for *.json. A missing path is an error."""
    files = {}
    for p in map(Path, paths):
        if p.is_dir():
            files.update((f, False) for f in sorted(p.rglob("*.json")) if f not in files)
        elif p.is_file():
            files[p] = True
        else:
            raise record.RecordError(f"{p}: no such input file or directory")
    return files


def read_records(paths):
    """``(records, passed_over)``: every record among ``paths``, checked against the schema.

    A file named explicitly must be a valid record. In a directory, JSON files that are not records
    (model configs, tokenizers, manifests) are passed over and counted; one that claims to be a
    record (it has a ``record`` field) must be valid too.
    """
    out, passed_over = [], 0
    for f, explicit in _files(paths).items():
        raw = f.read_bytes()
        if not explicit:
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = None
            if not record.is_record(doc):
                passed_over += 1
                continue
        doc = record.read(f)
        out.append({"path": str(f), "kind": doc["stage"], "doc": doc, "sha256": hashlib.sha256(raw).hexdigest(),
                    "model": doc["model"], "variant": doc["variant"], "environment": doc["environment"],
                    "records": doc.get("records") or [], "comparisons": doc.get("comparisons") or []})
    return out, passed_over


# --- per stage ---------------------------------------------------------------------------------


def _artifact_info(a):
    """The scalar figures of a quantize, pack or validate record, with what the tables add."""
    doc = a["doc"]
    info = scalars(doc, drop=("kind", "record", "stage"))
    if a["kind"] == "quantize":
        info["layers"] = len(doc["records"])
        if doc["records"]:
            info["layer_rel_mse"] = summarize([r["rel_mse"] for r in doc["records"]])
    elif a["kind"] == "pack":
        info["persist"] = "on" if doc["persist_rotation"] else "off"
    return info


def kivi_rows(doc):
    """bench-kivi's rows (one per S, op and mode, with per-arm summaries) -> (records, comparisons)."""
    recs, comps = [], []
    for row in doc["results"]:
        arms, floors = row["arms"], row["noise_floor"]
        ident = {"op": row["kind"], "mode": row["mode"], "S": row["S"]}
        for arm, st in arms.items():
            recs.append({**ident, "arm": arm, "unit": "s", **stats(st), "noise_floor": floors.get(arm)})
        if "speedup" in row and "kernel" in arms:
            base, other = arms["reference"], arms["kernel"]
            comps.append({**ident, "baseline_arm": "reference", "other_arm": "kernel", "baseline": base, "other": other,
                          "speedup": row["speedup"], "ratio": 1 / row["speedup"], "floor": max(floors.values(), default=None),
                          "verdict": row["verdict"],
                          **{k: row[k] for k in ("m4_speedup", "beats_m4", "outputs_equal", "kernel_bytes",
                                                 "kernel_bytes_per_s", "fraction_of_copy_bandwidth") if k in row}})
    return recs, comps


def quality_rows(doc):
    """bench-quality records hold one summary per metric (``kl``, ``top1``, ``ppl``): one row per metric
    and evaluation text (``text``: the records' top level is the first text; ``texts`` has the rest)."""
    recs = []
    first = next(iter(doc.get("texts") or {}), (doc.get("text") or {}).get("corpus", "devil"))
    for r in doc["records"]:
        ident = scalars(r)
        ident.setdefault("variant", _QUALITY_VARIANT.get(r["method"], "{method}-b{bits}").format(**{"rotation": "auto", **r}))
        if isinstance(r.get("bpw"), dict):
            ident.setdefault("bpw_matrices", r["bpw"].get("bpw_matrices"))
        per_text = [(first, r)] + [(c, t) for c, t in (r.get("texts") or {}).items() if c != first]
        for corpus, t in per_text:
            for key, st in t.items():
                if is_stats(st):
                    recs.append({**ident, "text": corpus, "metric": key, **stats(st), "mean": t.get(f"{key}_mean")})
    timing = [{**scalars(t), **{k: v for k, v in t.items() if is_stats(v)}} for t in doc.get("timing", [])]
    return recs, timing


def roofline_rows(a):
    """Achieved bandwidth and roofline points of a bench-decode record (the roofs of the same run)."""
    roof = a["doc"]["roofline"]
    bw, fl = roof["copy_bandwidth"], roof["matmul_flops"]
    rows = []
    for rec in (r for r in a["records"] if "weight_bytes" in r):  # the roofline arms (fp KV cache)
        st, ctx, fpt = stats(rec), rec["context"], rec["flops_per_token"]
        row = {"model": rec.get("model") or a["model"], "arm": rec["arm"], "variant": rec.get("variant") or rec["arm"],
               "precision": rec["precision"], "phase": rec["phase"], "context": ctx,
               "mean_context": rec.get("mean_context"), "tok_s": st, "peak_bandwidth": bw, "peak_flops": fl,
               "path": a["path"], "flops_per_s": {k: fpt * st[k] for k in ("median", "min", "max")}}
        if rec["phase"] == "decode":
            row.update(bytes_per_token=rec["bytes_per_token"], achieved=rec["achieved"],
                       intensity=fpt / rec["bytes_per_token"])
        else:  # a prefill of `context` tokens reads the weights once and writes the KV cache
            row["intensity"] = fpt * ctx / (rec["weight_bytes"] + rec["kv_bytes_per_position"] * ctx)
        rows.append(row)
    return rows


def _floors(a):
    """The record's A/A noise floors as a flat list (one per run, per arm or per record)."""
    f = a["doc"].get("noise_floor")
    vals = [f] if isinstance(f, (int, float)) else []
    if a["kind"] == "bench-kivi":
        vals += [v for row in a["doc"]["results"] for v in row["noise_floor"].values()]
    vals += [r["noise_floor"] for r in a["records"] if isinstance(r.get("noise_floor"), (int, float)) and r["noise_floor"] != f]
    return vals


# --- environments ------------------------------------------------------------------------------


def _env_key(env):
    return json.dumps({k: v for k, v in env.items() if k not in ("device_info", "loadavg")}, sort_keys=True, default=str)


def environments(arts):
    """Number the distinct environments (``env1`` ...) and set each artifact's ``env`` to its id."""
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
    return envs


def setup_warnings(arts):
    """(warnings, notes): artifacts without an environment, and setups that differ."""
    warnings, notes, by_blas, by_threads = [], [], {}, {}
    for a in arts:
        if a["env"]:
            env = a["environment"]
            by_blas.setdefault(f"{env.get('backend')}/{env['blas'].get('name')}", []).append(a["path"])
            by_threads.setdefault(numerics.key(env), []).append(a["path"])
        elif a["kind"] not in ("pack", "download"):  # they compute no floats
            warnings.append(f"{a['path']}: no environment recorded")
    if len(by_blas) > 1:
        warnings.append("artifacts come from different backend/BLAS setups ("
                        + "; ".join(f"{k}: {len(v)}" for k, v in sorted(by_blas.items()))
                        + " artifacts): compare figures only within one setup")
    elif len(by_threads) > 1:
        notes.append("BLAS thread counts differ between artifacts ("
                     + "; ".join(f"{k}: {len(v)}" for k, v in sorted(by_threads.items())) + " artifacts)")
    return warnings, notes


# --- quality against size ------------------------------------------------------------------------

# bench-quality methods that are vqpipe's own quantizer (the default recipe); every other method is
# another format, whatever its name (MLX affine groups, mlx-lm's other quantizers, an ablation).
VQPIPE_METHODS = ("vqpipe", "rotated")
# vqpipe's own ablations (its quantizer without a rotation): plotted, not what a verdict compares to.
ABLATIONS = ("unrotated",)


def _median(st):
    return st["median"] if is_stats(st) else None


def frontier(points):
    """The points no other point beats on both size and KL: smaller-or-equal bpw and lower-or-equal
    KL, one of them strictly. Sorted by bpw."""
    pts = [p for p in points if p["bpw"] is not None and p["kl"] is not None]
    out = [p for p in pts if not any(q["bpw"] <= p["bpw"] and q["kl"] <= p["kl"] and
                                     (q["bpw"] < p["bpw"] or q["kl"] < p["kl"]) for q in pts)]
    return sorted(out, key=lambda p: (p["bpw"], p["kl"]))


def quality_points(arts):
    """{model: {"source_ppl", "source", "synthetic", "points", "frontier"}} from bench-quality records.

    One point per (arm, bits) with a bpw: ``kl`` and ``top1`` are medians over windows; ``ppl`` is
    the perplexity over every token of the text (exp of the mean NLL, ``ppl_mean``), the figure
    docs quote; ``ppl_median`` the median of the windows' perplexities (the detail tables).
    """
    out = {}
    for a in (a for a in arts if a["kind"] == "bench-quality"):
        doc = a["doc"]
        src = doc.get("source") if isinstance(doc.get("source"), dict) else {}
        m = out.setdefault(doc.get("model") or a["model"] or "-", {"points": []})
        m["source_ppl"] = src.get("ppl_mean", _median(src.get("ppl")))
        m["source"] = src.get("source")
        m["synthetic"] = str(src.get("source") or "").startswith("synth:")
        m["full_precision"] = src.get("full_precision")
        for r in doc["records"]:
            b = r.get("bpw") if isinstance(r.get("bpw"), dict) else {}
            if r.get("skipped") or not isinstance(b.get("bpw"), (int, float)):
                continue
            arm = r.get("arm") or r["method"]
            m["points"].append({"arm": arm, "bits": r.get("bits"), "bpw": b["bpw"], "kl": _median(r.get("kl")),
                                "top1": _median(r.get("top1")), "ppl": r.get("ppl_mean", _median(r.get("ppl"))),
                                "ppl_median": _median(r.get("ppl")), "vqpipe": r["method"] in VQPIPE_METHODS,
                                "ablation": r["method"] in ABLATIONS})
    out = {k: m for k, m in out.items() if m["points"]}
    for m in out.values():
        m["points"].sort(key=lambda p: (p["arm"], p["bpw"]))
        m["frontier"] = [(p["arm"], p["bits"]) for p in frontier([p for p in m["points"] if not p["ablation"]])]
    return out


# --- the summary -------------------------------------------------------------------------------


def _slot(models, model, variant):
    return models.setdefault(model or "-", {}).setdefault(variant or "-", {})


def _bench(models, a):
    """Put a bench-load/-decode/-quality record's rows under models[model][variant][section]."""
    kind, doc, env, run = a["kind"], a["doc"], a["env"], Path(a["path"]).name
    recs, timing = quality_rows(doc) if kind == "bench-quality" else (a["records"], [])
    section = {"bench-load": "load", "bench-quality": "quality"}.get(kind)
    for rec in recs:
        item = {**scalars(rec), **{k: v for k, v in rec.items() if is_stats(v)}, **stats(rec),
                "noise_floor": rec.get("noise_floor", doc.get("noise_floor")), "environment": env, "run": run}
        variant = rec.get("variant") or rec.get("arm") or a["variant"]
        _slot(models, rec.get("model") or a["model"], variant).setdefault(section or rec["phase"], []).append(item)
    for c in a["comparisons"]:
        _slot(models, c.get("model") or a["model"], c["other_arm"]).setdefault("comparisons", []).append(
            {**c, "kind": kind, "environment": env, "run": run})
    for t in timing:
        _slot(models, a["model"], f"b{t['bits']}-{t['rotation']}").setdefault("quantize_timing", []).append(
            {**t, "environment": env})
    fresh = doc.get("fresh_load") or {}
    for rec in fresh.get("records") or []:  # bench-decode's fresh-process loads, per weights arm
        _slot(models, a["model"], rec["arm"]).setdefault("fresh_load", []).append(
            {**rec, "noise_floor": fresh.get("noise_floor"), "environment": env, "run": run})
    for c in fresh.get("comparisons") or []:
        _slot(models, a["model"], c["other_arm"]).setdefault("comparisons", []).append(
            {**c, "environment": env, "run": run})


def _kernels(arts):
    k = {"records": [], "comparisons": []}
    for a in (a for a in arts if a["kind"] == "bench-kivi"):
        recs, comps = kivi_rows(a["doc"])
        k["records"] += [{**r, "environment": a["env"]} for r in recs]
        k["comparisons"] += [{**c, "environment": a["env"]} for c in comps]
        k.setdefault("harness_overhead_s", []).append({"path": a["path"], **a["doc"]["harness_overhead_s"]})
    return k


def kv_quality(arts):
    """bench-kv-quality per model: each cache kind's KL / perplexity / top-1 / bytes per token, the
    fp16 yardstick and KIVI's pairing with mlx-lm's cache (the last record of a model wins)."""
    out = {}
    for a in (a for a in arts if a["kind"] == "bench-kv-quality"):
        doc, cfg, src = a["doc"], a["doc"].get("config") or {}, a["doc"].get("source_text") or {}
        order = [k for k in cfg.get("kinds") or [] if k in doc["results"]]
        kinds = {k: doc["results"][k] for k in order + sorted(set(doc["results"]) - set(order))}
        out[a["model"] or "-"] = {"kinds": kinds, "fp16_bytes_per_token": doc["fp16_bytes_per_token"],
                                  "paired": doc.get("paired") or {}, "length": cfg.get("length"),
                                  "chunk": cfg.get("chunk"), "windows": len(doc.get("windows") or []),
                                  "text": src.get("title") or src.get("corpus"),
                                  "kivi_residual": cfg.get("kivi_residual"), "mlx_group": cfg.get("mlx_group"),
                                  "dtype": doc.get("dtype"), "loaded": doc.get("loaded"), "path": a["path"],
                                  "environment": a["env"]}
    return out


def _measures(arts):
    """(noise floors, copy bandwidths) per artifact."""
    floors, bandwidth = [], []
    for a in arts:
        fl = _floors(a)
        if fl:
            floors.append({"path": a["path"], "kind": a["kind"], "model": a["model"], **summarize(fl)})
        src = a["doc"].get("copy_bandwidth") or (a["doc"].get("roofline") or {}).get("copy_bandwidth")
        if is_stats(src):
            bandwidth.append({"path": a["path"], "kind": a["kind"], "model": a["model"], **src})
    return floors, bandwidth


def build_summary(arts, passed_over=0):
    """The summary dict (summary.json) of ``arts`` (from ``read_records``)."""
    present = sorted({a["kind"] for a in arts})
    envs = environments(arts)
    warnings, notes = setup_warnings(arts)
    models, roofline, extras = {}, [], []
    for a in arts:
        if a["kind"] in ("quantize", "pack", "validate"):
            _slot(models, a["model"], a["variant"]).setdefault(a["kind"], []).append(
                {**_artifact_info(a), "environment": a["env"]})
        elif a["kind"] in ("bench-load", "bench-decode", "bench-quality"):
            _bench(models, a)
        if a["kind"] == "bench-decode":
            rows = roofline_rows(a)
            roofline += rows
            for r in rows:
                _slot(models, r["model"], r["variant"]).setdefault("roofline", []).append(r)
        rest = {k: v for k, v in a["doc"].items() if k in _EXTRAS}
        if rest and a["kind"].startswith("bench-"):
            extras.append({"path": a["path"], "run": Path(a["path"]).name, "kind": a["kind"], "model": a["model"], **rest})
    floors, bandwidth = _measures(arts)
    return {
        "schema": 2,  # 2: built from records (vqpipe/store/record.py); inputs that are not records stop the report
        "inputs": [{"path": a["path"], "kind": a["kind"], "sha256": a["sha256"], "environment": a["env"]} for a in arts],
        "present": present,
        "missing": [k for k in KINDS if k not in present],
        "passed_over": passed_over,
        "environments": envs,
        "warnings": warnings,
        "notes": notes,
        "noise_floors": floors,
        "copy_bandwidth": bandwidth,
        "models": models,
        "quality": quality_points(arts),
        "kernels": _kernels(arts),
        "kv_quality": kv_quality(arts),
        "roofline": roofline,
        "extras": extras,
        # Every record as read (minus environments and per-layer state metadata), so any figure not
        # tabulated above is still here.
        "artifacts": [{"path": a["path"], "kind": a["kind"], "environment": a["env"],
                       "data": {k: v for k, v in a["doc"].items() if k not in _NOT_COPIED}} for a in arts],
    }


def summary(paths):
    """Read the records among ``paths`` and summarize them (RecordError on a malformed one)."""
    arts, passed_over = read_records(paths)
    return build_summary(arts, passed_over)
