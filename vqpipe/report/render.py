"""The report's pages: summary (vqpipe/report/summary.py) + plots -> report.md, index.html, tables/*.html.

The sections below build the document as data (headings, paragraphs, tables, plots); the jinja2
templates in vqpipe/report/templates/ turn it into Markdown, one self-contained HTML page, and one small
HTML page per named table for Snakemake's report (captions: workflow/report/*.rst). Cells are
median with min–max and n throughout (docs/benchmarking.md).
"""

import base64

import jinja2

from .summary import is_stats

# The named tables, one HTML page each (results/report/tables/NAME.html, in Snakemake's report).
TABLES = ("environment", "validate", "quantize", "pack", "load", "load_comparisons", "quality", "decode",
          "decode_comparisons", "kernels", "roofline", "noise_floors", "inputs")


class _Doc:
    """The document as a list of blocks; named tables are also kept by name."""

    def __init__(self):
        self.blocks, self.tables = [], {}

    def h(self, level, text):
        self.blocks.append({"type": "h", "level": level, "text": text})

    def p(self, text, warn=False):
        self.blocks.append({"type": "p", "text": text, "warn": warn})

    def table(self, headers, rows, empty="(none among the inputs)", name=None):
        block = {"type": "table", "headers": headers, "rows": [[str(c) for c in r] for r in rows], "empty": empty}
        self.blocks.append(block if rows else {"type": "p", "text": empty, "warn": False})
        if name:
            self.tables[name] = block

    def img(self, name):
        self.blocks.append({"type": "img", "name": name})


_is_stats = is_stats


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
        d.table(["run", "model", "skipped arm", "reason"], [[run, model, s["arm"], s["reason"]] for s in x["skipped_arms"]],
                empty=f"{run}: skipped arms: none (every arm ran).")
    checks = [c for c in x.get("checks") or [] if isinstance(c, dict)]
    _decode_checks(d, x, run, model, checks)
    _amdahl(d, run, x.get("amdahl") or [])


def _decode_checks(d, x, run, model, checks):
    """Every output check, then the kernels-on-vs-off lossless verdict."""
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


def _amdahl_row(run, a, phase, ph):
    me = ph.get("measured") if isinstance(ph.get("measured"), dict) else {}
    sp, bound = me.get("speedup"), me.get("predicted_speedup_max_with_measured_reference")
    fl = me.get("floor") if isinstance(me.get("floor"), (int, float)) else 0.0
    within = "—" if not isinstance(sp, (int, float)) or not isinstance(bound, (int, float)) else (
        "yes" if sp <= bound else "above it, inside the noise floor" if sp <= bound * (1 + fl)
        else "NO (above it beyond the noise floor)")
    return [run, a.get("weights") or "—", _g(a.get("context")), phase,
            f"{_g(ph.get('launches_per_layer'))} × {_g(ph.get('layers'))}",
            _g((ph.get("saving_s_per_token") or 0) * 1e6), _g(ph.get("predicted_speedup_max")),
            *_cells(me.get("reference_s_per_token"), 1e3), *_cells(me.get("kernel_s_per_token"), 1e3),
            _g(sp), _g(bound), _pct(me.get("floor")), f"{me.get('verdict') or '—'}; within bound: {within}"]


def _amdahl(d, run, am):
    """The Amdahl prediction (before timing) against the measured kivi-kernel vs kivi-ref speedup."""
    rows = []
    for a in (a for a in am if isinstance(a, dict)):
        for phase in ("decode", "prefill"):
            ph = a.get(phase) if isinstance(a.get(phase), dict) else None
            if ph is not None:
                rows.append(_amdahl_row(run, a, phase, ph))
            elif a.get("reason"):
                rows.append([run, a.get("weights") or "—", _g(a.get("context")), phase] + ["—"] * 11 + [a["reason"]])
    if am:
        d.p(f"{run}: Amdahl. Predicted (before timing, from bench-kivi's per-flush figures and the pilot's kivi-ref "
            "time): the saving per token and the bound on the speedup; measured: kivi-kernel vs kivi-ref per token "
            "(ms), the measured speedup and the bound recomputed with the measured reference time.")
    d.table(["run", "weights", "context", "phase", "flush launches × layers", "predicted saving (µs/token)",
             "predicted speedup ≤", "reference n", "median (ms/token)", "min–max", "kernel n", "median (ms/token)", "min–max",
             "measured speedup", "bound (with the measured reference time)", "noise floor", "verdict"], rows,
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
            "(codes + scales/biases/norms + codebooks + rotations) per weight; \"rotations stored as seeds\": "
            "the same with persist_rotation off. Perplexity here is the median [min–max] of the windows' own "
            "perplexities; \"perplexity (all tokens)\" is exp(mean NLL) over every token, the figure the summary uses.")
        if src.get("full_precision") is False:
            d.p(f"The source is not a full-precision model: {src.get('note')} (GGUF tensor types: "
                f"{src.get('gguf_types')}). Every figure is a distance to this dequantized model.", warn=True)
        # the other evaluation texts (the first is the records' top level)
        others = [c for c in (x.get("texts") or {})][1:]
        if others:
            d.p("Also on " + "; ".join(f"{c}: {x['texts'][c].get('title')} ({x['texts'][c].get('license')}; "
                                         f"{x['texts'][c].get('package')} {x['texts'][c].get('package_version')})"
                                         for c in others) + ", a domain the calibration text is not.")
        rows = []
        for r in x.get("records") or []:
            if r.get("skipped"):
                rows.append([_g(r.get("bits")), r.get("method"), f"skipped: {r['skipped']}"] + [""] * (7 + 2 * len(others)))
                continue
            b = r.get("bpw") or {}
            t = r.get("texts") or {}
            rows.append([_g(r.get("bits")), r.get("method"), _g(b.get("bpw"), 4), _g(b.get("bpw_seed_rotation"), 4),
                         _g(b.get("bpw_matrices"), 4), _g(r.get("ppl_mean")), _st(r.get("ppl")), _st(r.get("kl")),
                         _st(r.get("top1"), 3)]
                        + [v for c in others for v in (_st((t.get(c) or {}).get("ppl")), _st((t.get(c) or {}).get("kl")))]
                        + [_g(r.get("weight_rel_mse"), 4)])
        d.table(["bits", "arm", "bpw", "bpw (rotations stored as seeds)", "bpw (all matrices)", "perplexity (all tokens)",
                 "perplexity (windows)", "KL", "top-1"]
                + [h for c in others for h in (f"perplexity ({c})", f"KL ({c})")] + ["weight rel. MSE"], rows)
        dense = ((x.get("records") or [{}])[0].get("bpw") or {}).get("unquantized_params")
        if dense:
            d.p(f"Kept unquantized by {x['records'][0].get('method')} (parameters; each record lists its own): " + ", ".join(f"{k} {v:,}" for k, v in dense.items()) + ".")
        g = x.get("generations") or {}
        prompts = g.get("prompts") or []
        if prompts:
            d.p(f"Greedy generations ({g.get('max_tokens')} tokens, chat template) of the source and every arm:")
            d.table(["arm"] + [f"“{p}”" for p in prompts],
                    [[a.get("arm")] + [t if str(t).strip() else "(empty: this arm generated no visible text)"
                                       for t in a.get("texts") or []] for a in g.get("arms") or []])



# --- sections ------------------------------------------------------------------------------------


def _overview(d, summary):
    d.h(2, "Plumbing")
    d.p("The sections from here on check how the numbers above were made: the artifacts read, the software "
        "and hardware, the byte-exact reload of every reservoir (validate), the quantize and pack stages, "
        "the noise floors.")
    d.p(f"Built from {len(summary['inputs'])} artifacts ({', '.join(summary['present']) or 'none'}). "
        f"Missing kinds: {', '.join(summary['missing']) or 'none'}."
        + (f" {summary['passed_over']} other JSON files in the input directories are not artifacts."
           if summary.get("passed_over") else ""))


# --- the first screen: the answer ------------------------------------------------------------------


def _f(x, digits=3):
    return "—" if not isinstance(x, (int, float)) else f"{x:.{digits}g}"


def _against(p, pts):
    """The other arm with the lowest KL among those no larger than ``p`` (None if there is none)."""
    others = [o for o in pts if not (o["vqpipe"] or o["ablation"]) and o["kl"] is not None and o["bpw"] <= p["bpw"] + 1e-3]
    return min(others, key=lambda o: o["kl"], default=None)


def _quality_verdict(d, model, q):
    pts, src = q["points"], q.get("source_ppl")
    ours = sorted((p for p in pts if p["vqpipe"]), key=lambda p: p["bpw"])
    front = {tuple(k) for k in q["frontier"]}
    arms = sorted({p["arm"] for p in pts if not (p["vqpipe"] or p["ablation"])})
    if not ours:
        d.p(f"{model}: no vqpipe arm among its bench-quality records (arms: {', '.join(arms) or 'none'}).")
        return
    on = [f"{p['bits']}" for p in ours if (p["arm"], p["bits"]) in front]
    off = [f"{p['bits']}" for p in ours if (p["arm"], p["bits"]) not in front]
    verdict = (f"vqpipe is on the quality-per-bit frontier at {', '.join(on)} bits" if on else
               "vqpipe is not on the quality-per-bit frontier at any width measured")
    if on and off:
        verdict += f", not at {', '.join(off)}"
    d.p(f"Verdict: {verdict}: no other format measured here ({', '.join(arms) or 'none'}) is both as small and "
        "closer to the source there.")
    d.p("Terms: an arm is one thing measured side by side (vqpipe at a bit width, or another format at one). "
        "KL is how far an arm's next-token distribution is from the source model's (nats per token, median over "
        "the evaluation windows; 0 = the same model). Bits per weight (bpw) count everything stored for the "
        "model's matrices, embedding included. Perplexity is exp(mean negative log-likelihood) over every token "
        "of the evaluation text" + (f" (the source's: {_f(src, 4)})" if isinstance(src, (int, float)) else "")
        + ". The frontier: the arms no other arm beats on both size and KL (vqpipe's own ablations, such as "
        "its unrotated arm, left out).")
    if q.get("synthetic"):
        d.p(f"{model} is a synthetic model (random weights): its perplexity on real text means nothing; compare "
            "the arms by KL.", warn=True)
    elif q.get("full_precision") is False:
        d.p(f"{model}'s source is itself a quantized checkpoint (dequantized): every figure is a distance to it.")
    rows = []
    for p in ours:
        o = _against(p, pts)
        rel = (f" ({p['ppl'] / src:.3f}× source)" if isinstance(src, (int, float)) and isinstance(p["ppl"], (int, float))
               else "")
        base = [f"{p['bits']}", f"{p['bpw']:.3f}", _f(p["kl"]), _f(p["ppl"], 4) + rel]
        if o is None:
            rows.append(base + ["none at this size or smaller", "—", "—", "—", "—"])
            continue
        ratio = o["kl"] / p["kl"] if p["kl"] else None
        rows.append(base + [f"{o['arm']} ({o['bits']}-bit)", f"{o['bpw']:.3f}", _f(o["kl"]), _f(o["ppl"], 4),
                            "—" if ratio is None else f"{ratio:.3g}× " + ("lower" if ratio >= 1 else "higher")])
    d.table(["vqpipe bits", "bpw", "KL", "perplexity", "best other arm no larger (lowest KL)", "its bpw", "its KL",
             "its perplexity", "vqpipe's KL"], rows)


def _speed_rows(dd_list):
    """(weights rows, KIVI rows) of bench-decode's decode records: each arm at its largest context."""
    best = {}
    for r in dd_list:
        if r.get("phase") != "decode" or not _is_stats(r):
            continue
        key = (r.get("run"), r.get("arm"))
        if key not in best or (r.get("context") or 0) > (best[key].get("context") or 0):
            best[key] = r
    weights, kivi = [], []
    for r in best.values():
        row = [r.get("arm") or "—", r.get("precision") or r.get("weights") or "—", r.get("cache") or "—",
               _g(r.get("context")), _st(r, 4), _g(r.get("n")), _bytes(r.get("weight_bytes")),
               _bytes(r.get("peak_over_start_bytes", r.get("peak_memory_bytes")))]
        (kivi if "kivi" in str(r.get("cache") or r.get("arm")) else weights).append(row)
    return weights, kivi


def _decode_verdict(d, model, decode, comps):
    """One sentence: vqpipe's decode tokens/s beside each other weight arm's (fp KV cache, the longest
    context), with the ratio of the medians and the A/A noise floor (bench-decode's comparisons)."""
    recs = [r for r in decode if r.get("phase") == "decode" and r.get("cache") == "fp" and _is_stats(r)]
    if not recs:
        return
    context = max(r.get("context") or 0 for r in recs)
    by = {r.get("weights"): r for r in recs if r.get("context") == context}
    ours = by.get("vqpipe")
    if ours is None:
        return
    cmp = {c.get("other_arm"): c for c in comps if c.get("kind") == "bench-decode" and c.get("phase") == "decode"
           and c.get("context") == context and c.get("baseline_arm") == "vqpipe/fp"}
    parts = []
    for w, r in by.items():
        c = cmp.get(f"{w}/fp")
        if w == "vqpipe" or c is None:
            continue
        ratio = c.get("ratio")  # median(other's seconds) / median(vqpipe's): vqpipe's speed over the other's
        within = c.get("verdict") == "no measurable difference"
        parts.append(f"mlx-lm on {r.get('precision')}: {_st(r, 3)} tok/s, n = {r.get('n')} (vqpipe "
                     + ("not measurably different" if within else f"{_g(ratio, 3)}× its speed")
                     + f"; A/A noise floor {_pct(c.get('floor'))})")
    d.p(f"Verdict on speed: on this machine's CPU, {model}'s reservoir ({ours.get('precision')}) decodes at "
        f"{_st(ours, 3)} tok/s (median [min–max], n = {ours.get('n')} generations of {ours.get('tokens')} greedy "
        f"tokens after {context} prompt tokens)"
        + ("; beside it, interleaved in the same process, " + "; ".join(parts) if parts else "")
        + ". Measured while the pipeline's other jobs ran on the other core (bench-decode).")


def _fresh_load(d, model, fresh, comps):
    """bench-decode's fresh-process loads: each weights arm's time to a usable model, phase by phase."""
    by = {c.get("other_arm"): c for c in comps if c.get("kind") == "fresh-load"}
    base = next((c.get("baseline_arm") for c in by.values()), None)
    def against(r):
        c = by.get(r.get("arm"))
        if r.get("arm") == base:
            return f"baseline (A/A floor {_pct(r.get('noise_floor'))})"
        if c is None:
            return "—"
        within = " (within the floor)" if c.get("verdict") == "no measurable difference" else ""
        return f"{_g(c['speedup'], 3)}× the baseline's speed{within}"

    rows = []
    for r in fresh:
        vs = against(r)
        rows.append([r.get("arm"), r.get("precision") or "—", _st(r, 3), _g(r.get("n")), _med(r.get("import_s")),
                     _med(r.get("load_s")), _med(r.get("first_logits_s")), _med(r.get("vm_hwm_bytes"), _bytes), vs])
    d.p(f"{model}: time to a usable model in a fresh process, as `vqpipe generate` or `mlx_lm.generate` pays it "
        "before its prompt: its imports, loading (vqpipe.load of the reservoir; mlx_lm.load of the source and "
        "of the affine conversion) and the logits of one token, each phase timed apart. Fresh processes, "
        "interleaved, warm page cache. From bench-decode.")
    d.table(["arm", "weights", "imports + load + first logits (s) median [min–max]", "n", "imports (s, median)",
             "load (s, median)", "first logits (s, median)", "peak RSS (median)", "against the baseline"], rows)


def _speed(d, model, variants):
    decode = [r for dd in variants.values() for r in dd.get("decode", [])]
    load = [r for dd in variants.values() for r in dd.get("load", [])]
    comps = [c for dd in variants.values() for c in dd.get("comparisons", [])]
    weights, kivi = _speed_rows(decode)
    head = ["arm", "weights", "KV cache", "context (tokens)", "decode tok/s median [min–max]", "n",
            "weights read per token", "peak memory (the generation's own)"]
    if weights:
        _decode_verdict(d, model, decode, comps)
        d.p(f"{model}: decode speed and memory of vqpipe's reservoir beside mlx-lm's own weights (the source as "
            "stored, MLX affine as mlx_lm.convert -q makes it), each at the longest context measured; peak memory "
            "is the generation's own (MLX's peak minus what was allocated before it). From bench-decode.")
        d.table(head, weights)
    fresh = [r for dd in variants.values() for r in dd.get("fresh_load", [])]
    if fresh:
        _fresh_load(d, model, fresh, comps)
    if load:
        d.p(f"{model}: time to a usable model in a fresh process: re-quantizing the source against loading the "
            "reservoir (persist_rotation on: rotations stored as matrices; off: as seeds, regenerated at load). "
            "From bench-load.")
        d.table(["arm", "seconds median [min–max]", "n", "file size", "MLX peak memory (median)"],
                [[r.get("arm") or "—", _st(r, 3), _g(r.get("n")), _bytes(r.get("file_bytes")),
                  _med(r.get("mlx_peak_bytes"), _bytes)] for r in load])
    if kivi:
        d.p(f"{model}: the KIVI quantized KV cache (keys per channel, values per token, a full-precision window) "
            "against the full-precision cache: kivi-ref is the MLX-ops reference, kivi-kernel the fused kernel "
            "(GPU only). From bench-decode.")
        d.table(head, kivi)


def _kv_what(kind, kv):
    """What a bench-kv-quality cache kind is, with the settings its record names."""
    if kind.startswith("kivi"):
        return (f"KIVI: keys per channel, values per token, the newest {kv['kivi_residual'] or '—'} tokens exact "
                f"(vqpipe generate --kv-bits {kind.removeprefix('kivi')})")
    if kind.startswith("mlx-q"):
        return (f"mlx-lm's QuantizedKVCache, affine per token, group {kv['mlx_group'] or '—'} "
                f"(mlx_lm.generate --kv-bits {kind.removeprefix('mlx-q')})")
    return "mlx-lm's KVCache, full precision (the reference)" if kind == "fp" else kind


def _kv_quality(d, model, kv):
    """The KV cache's memory and quality on real text (bench-kv-quality): verdict, then a table."""
    kinds, f16 = kv["kinds"], kv["fp16_bytes_per_token"]
    ratio = {k: r["bytes_per_token"]["median"] / f16 for k, r in kinds.items()}
    fp_ppl = kinds["fp"]["ppl"]["median"]
    parts = []
    for k in (k for k in kinds if k.startswith("kivi")):
        r = kinds[k]
        txt = (f"{k.replace('kivi', 'KIVI-')} holds {ratio[k]:.2f}× the bytes of an fp16 cache at {kv['length']} tokens "
               f"with KL {_g(r['kl']['median'], 3)} to the full-precision cache (perplexity "
               f"{(r['ppl']['median'] / fp_ppl - 1):+.1%})")
        pair = kv["paired"].get(f"{k} vs mlx-q{k.removeprefix('kivi')}")
        other = kinds.get(f"mlx-q{k.removeprefix('kivi')}")
        if pair and other:
            kr = pair.get("kl_ratio") or {}
            txt += (f"; mlx-lm's {k.removeprefix('kivi')}-bit QuantizedKVCache holds {ratio[f'mlx-q' + k.removeprefix('kivi')]:.2f}× "
                    f"with KL {_g(other['kl']['median'], 3)}: KIVI's KL is lower in {pair['kivi_lower_kl']} of "
                    f"{pair['windows']} windows" + (f", {_g(kr.get('median'), 3)}× lower (median)" if kr else ""))
        parts.append(txt)
    d.p(f"Verdict on the KV cache: {'; '.join(parts) or 'no KIVI kind ran'}. {kv['windows']} windows of "
        f"{kv['length']} tokens of {kv['text']}, stored {kv['chunk']} tokens at a time (as a prefill step does), "
        f"on {model}'s {kv['loaded'] or 'model'} at {kv['dtype']}. From bench-kv-quality.")
    d.p("Bytes per token: each cache's resident buffers at the window's end over its tokens (full-precision parts "
        "at the run's dtype, buffers as allocated); the fp16 cache is the same tokens' keys and values at 2 bytes, "
        "computed from the model's geometry. KL here is to the same model with the full-precision cache, not to the "
        "source model.")
    fp_bytes = kinds["fp"]["bytes_per_token"]["median"]
    rows = [[k, _kv_what(k, kv), _bytes(r["bytes_per_token"]["median"]), f"{ratio[k]:.3f}×",
             f"{r['bytes_per_token']['median'] / fp_bytes:.3f}×", _st(r["kl"], 3), _st(r["ppl"], 4), _st(r["top1"], 3)]
            for k, r in kinds.items()]
    d.table(["cache", "what it is", "bytes per token", "× fp16 cache", f"× the fp cache as run ({kv['dtype']})",
             "KL to the fp cache median [min–max]", "perplexity median [min–max]", "top-1 agreement with the fp cache"],
            rows)


def _summary(d, summary):
    """The first screen: per model the verdict on quality per bit, the plot, then speed and memory."""
    d.h(1, "vqpipe report")
    quality = summary.get("quality") or {}
    models = sorted(set(quality) | set(summary["models"]) | set(summary.get("kv_quality") or {}),
                    key=lambda m: (m not in quality, bool((quality.get(m) or {}).get("synthetic")), m))
    d.h(2, "Summary")
    for w in summary["warnings"]:
        d.p(w, warn=True)
    if not quality:
        d.p("No bench-quality artifact among the inputs: no quality verdict.")
    for m in (m for m in models if m in quality):
        d.h(3, f"{m}: quality per bit")
        _quality_verdict(d, m, quality[m])
    if quality:
        d.img("quality_bits")
    for m in models:
        variants = summary["models"].get(m) or {}
        if any(dd.get("decode") or dd.get("load") for dd in variants.values()):
            d.h(3, f"{m}: speed and memory")
            _speed(d, m, variants)
        kv = (summary.get("kv_quality") or {}).get(m)
        if kv:
            d.h(3, f"{m}: KV cache memory and quality")
            _kv_quality(d, m, kv)
    d.p("Every timing is a median with its min–max range over n samples. Differences smaller than the A/A noise "
        "floor (an arm timed against itself, interleaved: what noise alone moves) are reported as "
        "\"no measurable difference\" (docs/benchmarking.md).")
    for n in summary["notes"]:
        d.p(n)


def _environment(d, summary):
    d.h(2, "Plumbing: environments")
    rows = []
    for e in summary["environments"]:
        env, b = e["environment"], e["environment"].get("blas") or {}
        v = env.get("versions") or {}
        rows.append([e["id"], env.get("backend"), env.get("device"), env.get("cpu_model"), env.get("cpu_count"),
                     env.get("gpu_name") or "—", f"{b.get('name')} ({b.get('path')})", b.get("threads") or "—",
                     v.get("mlx"), v.get("mlx-lm"), v.get("numpy"), v.get("python"), env.get("platform"),
                     len(e["artifacts"]), _range(e.get("loadavg_1min"))])
    d.table(["id", "backend", "device", "CPU", "CPUs", "GPU", "BLAS", "BLAS threads", "mlx", "mlx-lm", "numpy", "python",
             "platform", "artifacts", "load avg (1 min) min–max"], rows, name="environment")


def _validate(d, models):
    d.h(2, "Plumbing: validate (byte-exact reload of every reservoir)")
    rows = []
    for m, v, r in _each(models, "validate"):
        verdict = {True: "PASS (bit-exact)", False: "FAIL", None: "REFUSED"}.get(r.get("bit_exact"), "—")
        rows.append([m, v, r.get("persist_rotation") or "—", verdict, _g(r.get("n_prompts")), _g(r.get("max_abs_diff")),
                     _g(r.get("load_seconds")), r.get("environment") or "—", r.get("reason") or "—"])
    d.table(["model", "variant", "persist_rotation", "verdict", "prompts", "max |diff|", "load (s)", "environment",
             "reason"], rows, name="validate")


def _quantize(d, models):
    d.h(2, "Plumbing: quantize and pack")
    d.table(["model", "variant", "bits", "rotation", "dtype", "layers", "quantize (s)", "peak RSS", "layer rel. MSE n",
             "median", "min–max"],
            [[m, v, _g(r.get("bits")), _g(r.get("rotation")), _g(r.get("dtype")), _g(r.get("layers")),
              _g(r.get("quantize_seconds")), _bytes(r.get("peak_rss_bytes")), *_cells(r.get("layer_rel_mse"))]
             for m, v, r in _each(models, "quantize")], name="quantize")
    d.table(["model", "variant", "persist_rotation", "file size", "file / ideal payload", "pack (s)"],
            [[m, v, r["persist"], _bytes(r.get("file_bytes")), _g(r.get("file_over_ideal")), _g(r.get("seconds"))]
             for m, v, r in _each(models, "pack")],
            empty="(no pack.json among the inputs: reservoir file sizes are in the load benchmark)", name="pack")


def _load(d, summary):
    models = summary["models"]
    d.h(2, "Load time in detail")
    rows = [[m, r.get("arm") or v, r.get("variant") or "—", *_cells(r), _bytes(r.get("file_bytes")),
             _med(r.get("mlx_peak_bytes"), _bytes), _med(r.get("rss_bytes"), _bytes), _pct(r.get("noise_floor"))]
            for m, v, r in _each(models, "load")]
    d.table(["model", "arm", "variant", "n", "median (s)", "min–max (s)", "file size", "MLX peak (median)",
             "RSS (median)", "noise floor"], rows, name="load")
    comps = [dict(c, model=m) for m, v, c in _each(models, "comparisons") if c.get("kind") == "bench-load"]
    d.table(["model"] + _COMP_HEAD, _comparison_rows(comps, ("model",)), empty="(no load comparisons)",
            name="load_comparisons")
    d.img("load_time")
    for x in (x for x in summary["extras"] if x["kind"] == "bench-load"):
        _load_extras(d, x)


def _load_extras(d, x):
    """bench-load's checks, copy paths and the several-processes experiment. (Its targets, goals whose
    reasons the record does not carry, stay in summary.json.)"""
    if isinstance(x.get("checks"), dict):
        d.table(["model", "check", "result"], [[x["model"], k, _g(t)] for k, t in x["checks"].items()])
    d.table(["model", "copy path", "copies", "bytes", "n", "median (s)", "min–max (s)", "GB/s (median)"],
            [[x["model"], c["method"], _g(c.get("copies")), _bytes(c["bytes"]), *_cells(c),
              _g((c.get("bytes_per_s") or 0) / 1e9)] for c in x.get("copy_paths", [])], empty="(no copy-path figures)")
    mp = x.get("multiprocess")
    if mp:
        rows = []
        for what in ("reservoir_load", "requantize"):
            for k, st in (mp.get(what) or {}).items():
                if _is_stats(st):
                    rows.append([x["model"], what, mp.get("procs"), k, *_cells(st, fmt=_bytes if k != "seconds" else None)])
        d.p("Several processes loading at once: Rss is a process's resident memory, Pss the same with pages "
            "shared between processes divided among them, Pss_Anon the part of Pss not backed by a file (the "
            "process's own heap); from /proc/PID/smaps_rollup.")
        d.table(["model", "processes at once", "procs", "figure", "n", "median", "min–max"], rows)


def _quality(d, summary):
    models = summary["models"]
    d.h(2, "Quality in detail")
    if not summary.get("quality"):
        d.img("quality_bits")  # it says which artifact is missing; with data it leads the summary
    _render_user_quality(d, summary)
    d.table(["model", "variant", "method", "bits", "metric", "n", "median", "min–max", "mean", "weight rel. MSE", "tokens"],
            [[m, v, r.get("method") or "—", _g(r.get("bits")), r.get("metric") or "—", *_cells(r, digits=5),
              _g(r.get("mean"), 5), _g(r.get("weight_rel_mse"), 5), _g(r.get("tokens"))]
             for m, v, r in _each(models, "quality")], name="quality")
    rows = [[m, v, *_cells(r.get("seconds")), *_cells(r.get("peak_rss_bytes"), fmt=_bytes), _bytes(r.get("source_bytes"))]
            for m, v, r in _each(models, "quantize_timing")]
    if rows:
        d.table(["model", "variant", "quantize n", "median (s)", "min–max (s)", "peak RSS n", "median", "min–max",
                 "source size"], rows)


_PEAK_NOTE = ("Peak memory is one pilot generation per arm (n = 1): \"generation's own peak\" is peak_over_start_bytes "
              "(mx.get_peak_memory() minus what was allocated before the generation), \"process peak\" is "
              "peak_memory_bytes (every model resident in the process included). The plot shows the generation's own "
              "peak where an artifact records it, the process peak otherwise (its axis label says which).")


def _decode(d, summary):
    models = summary["models"]
    d.h(2, "Decode and prefill in detail")
    rows = []
    for m, vs in models.items():
        for v, dd in vs.items():
            for phase in ("decode", "prefill"):
                for r in sorted(dd.get(phase, []), key=lambda r: (str(r.get("run")), r.get("context") or 0)):
                    rows.append([r.get("run") or "—", m, r.get("arm") or v, r.get("precision") or "—", phase,
                                 _g(r.get("context")), *_cells(r), _bytes(r.get("peak_over_start_bytes")),
                                 _bytes(r.get("peak_memory_bytes")), _pct(r.get("noise_floor"))])
    d.table(["run", "model", "arm", "precision", "phase", "context", "n", "median (tok/s)", "min–max (tok/s)",
             "generation's own peak", "process peak", "noise floor"], rows, name="decode")
    if rows:
        d.p(_PEAK_NOTE)
    comps = [dict(c, model=m) for m, v, c in _each(models, "comparisons") if c.get("kind") == "bench-decode"]
    comps.sort(key=lambda c: (str(c.get("run")), c.get("context") or 0, str(c.get("phase"))))
    d.table(["run", "model", "phase", "context"] + _COMP_HEAD, _comparison_rows(comps, ("run", "model", "phase", "context")),
            empty="(no decode comparisons)", name="decode_comparisons")
    d.img("decode_context")
    for x in (x for x in summary["extras"] if x["kind"] == "bench-decode"):
        _render_decode_extras(d, x)


_KERNEL_HEAD = ["op", "mode", "S", "reference n", "median (µs)", "min–max (µs)", "kernel n", "median (µs)",
                "min–max (µs)", "ratio kernel/ref", "speedup", "speedup min–max", "noise floor", "verdict",
                "kernel GB/s (median)", "of copy bandwidth", "outputs equal", "M4 speedup (KIVI issue)"]


def _kernel_row(c):
    b, o = c["baseline"], c["other"]
    bps = c.get("kernel_bytes_per_s")
    m4 = "—" if c.get("m4_speedup") is None else f"{_g(c['m4_speedup'])} ({'beaten' if c.get('beats_m4') else 'not beaten'})"
    return [c.get("op") or "—", c.get("mode") or "—", _g(c.get("S")), *_cells(b, 1e6), *_cells(o, 1e6),
            _g(c.get("ratio")), _g(c["speedup"]), f"{_g(b['min'] / o['max'])}–{_g(b['max'] / o['min'])}",
            _pct(c.get("floor")), (c.get("verdict") or "—").split(" (")[0],
            _g(bps / 1e9) if isinstance(bps, (int, float)) else "—",
            _pct(c.get("fraction_of_copy_bandwidth")).lstrip("±"), _g(c.get("outputs_equal")), m4]


def _kernels(d, summary):
    d.h(2, "Kernels (KIVI)")
    k = summary["kernels"]
    comps = sorted(k["comparisons"], key=lambda c: (str(c.get("op")), str(c.get("mode")), c.get("S") or 0))
    if comps:
        d.p("Per flush, kernel against the MLX-ops reference, interleaved in one process. ratio = median(kernel) / "
            "median(reference); speedup = its inverse; the floor is the larger of the two arms' A/A floors. GB/s: the "
            "fewest bytes one launch must move over the kernel's median time, and its share of the copy bandwidth "
            "measured in the same run.")
        d.table(_KERNEL_HEAD, [_kernel_row(c) for c in comps], name="kernels")
    else:
        d.table(["op", "mode", "arm", "S", "n", "median (µs)", "min–max (µs)", "noise floor"],
                [[r.get("op") or "—", r.get("mode") or "—", r.get("arm") or "—", _g(r.get("S")), *_cells(r, 1e6),
                  _pct(r.get("noise_floor"))] for r in k["records"] if not str(r.get("arm", "")).endswith("(A/A)")],
                empty="(no bench-kivi artifact)", name="kernels")
        if k["records"]:
            d.p("No kernel arm ran (no Metal/CUDA backend where the artifact was made): reference timings only.")
    ov = k.get("harness_overhead_s") or []
    if ov:
        d.table(["artifact", "empty timed call n", "median (µs)", "min–max (µs)"], [[o["path"], *_cells(o, 1e6)] for o in ov])
    d.img("kernel_speedup")


def _roofline(d, summary):
    d.h(2, "Plumbing: roofline")
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
            empty="(no achieved-bandwidth figures: no bench-decode artifact)", name="roofline")
    d.img("roofline")


def _floors_and_inputs(d, summary):
    d.h(2, "Plumbing: noise floors")
    d.table(["artifact", "kind", "model", "floors n", "median", "min–max"],
            [[f["path"], f["kind"], f.get("model") or "—", *_cells(f, fmt=lambda v: f"±{v:.1%}")]
             for f in summary["noise_floors"]], name="noise_floors")
    d.h(2, "Plumbing: input files")
    d.table(["path", "kind", "environment", "sha256"],
            [[i["path"], i["kind"], i["environment"] or "—", i["sha256"][:16]] for i in summary["inputs"]], name="inputs")


def document(summary):
    """The report as a _Doc: every section in order."""
    d = _Doc()
    _summary(d, summary)
    _quality(d, summary)
    _decode(d, summary)
    _load(d, summary)
    _kernels(d, summary)
    _overview(d, summary)
    _environment(d, summary)
    _validate(d, summary["models"])
    _quantize(d, summary["models"])
    _roofline(d, summary)
    _floors_and_inputs(d, summary)
    return d


# --- templates ---------------------------------------------------------------------------------


def _md_cell(s):
    return str(s).replace("|", "\\|").replace("\n", " ")


def _templates():
    env = jinja2.Environment(loader=jinja2.PackageLoader("vqpipe.report", "templates"), trim_blocks=True, lstrip_blocks=True,
                             autoescape=jinja2.select_autoescape(["html.j2"]), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters["mdcell"] = _md_cell
    return env


def pages(summary, plots, title="vqpipe report"):
    """{relative path: text}: report.md, index.html (plots embedded) and tables/NAME.html for every TABLES name."""
    d, env = document(summary), _templates()
    images = {name: base64.b64encode(png).decode() for name, png in plots.items()}
    out = {"report.md": env.get_template("report.md.j2").render(blocks=d.blocks),
           "index.html": env.get_template("report.html.j2").render(blocks=d.blocks, images=images, title=title)}
    for name in TABLES:
        block = d.tables.get(name) or {"headers": [], "rows": [], "empty": "(not in this report)"}
        out[f"tables/{name}.html"] = env.get_template("table.html.j2").render(t=block, title=f"{title}: {name}")
    return out
