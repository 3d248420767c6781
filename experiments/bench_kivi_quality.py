"""bench-kivi-quality: long-context quality of KIVI caches against the full-precision cache.

Windows of real English text (``--text``: the eval split of The Devil's Dictionary by default, or
``all`` of it: nothing here is fitted on text, so the calibration split is fair game for a cache on
the source model; ``corpus`` is the repository's template text, for the synthetic tokenizers), evenly
spread over it. Each window of ``--length`` tokens runs through the model in ``--chunk``-token pieces,
once per cache kind, all kinds chunk by chunk side by side; per kind: perplexity of the window's next
tokens, mean KL(full-precision cache || kind) over positions, and top-1 agreement with the
full-precision cache. Kinds: ``fp`` (mlx-lm's KVCache at the model dtype), ``kivi<b>`` (the packed
KIVI cache, G = 32, R = 128; keys per channel, values per token) and ``mlx-q<b>`` (mlx-lm's
QuantizedKVCache: keys and values per token, affine, group 64, no full-precision residual).
Chunked processing means a chunk attends to what each cache holds after storing it, as in
generation with that prefill step. Where both ``kivi<b>`` and ``mlx-q<b>`` ran, the result says
which has the lower KL in how many windows and the median of their per-window KL ratio.

    python -m experiments.bench_kivi_quality --model DIR --text eval --out results/bench/kivi_quality.json
"""

import argparse
import math
import statistics
import sys

import mlx.core as mx

from vqpipe.store.fsutil import write_json
from vqpipe.kivi.cache import make_kivi_cache


def _cache(model, kind):
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    if kind == "fp":
        return make_prompt_cache(model)
    bits = int(kind.rsplit("q", 1)[-1] if kind.startswith("mlx-q") else kind.removeprefix("kivi"))
    if kind.startswith("mlx-q"):
        return [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    return make_kivi_cache(model, bits, 32, 128, packed=True)


def window(model, ids, kinds, chunk):
    """Per kind: (sum of next-token NLL, sum of KL vs fp, top-1 agreements with fp, positions)."""
    caches = {k: _cache(model, k) for k in kinds}
    acc = {k: [0.0, 0.0, 0, 0] for k in kinds}
    for a in range(0, len(ids) - 1, chunk):
        x = mx.array(ids[a : a + chunk])[None]
        target = mx.array(ids[a + 1 : a + 1 + chunk])
        n = target.shape[0]
        logp = {}
        for k in kinds:
            out = model(x, cache=caches[k])[0, :n].astype(mx.float32)
            logp[k] = out - mx.logsumexp(out, axis=-1, keepdims=True)
            mx.eval(logp[k], [c.state for c in caches[k]])
        ref = logp["fp"]
        pref = mx.exp(ref)
        top = mx.argmax(ref, axis=-1)
        print(f"  tokens {a + n}/{len(ids) - 1}", flush=True)
        for k in kinds:
            nll = -mx.take_along_axis(logp[k], target[:, None], axis=-1).sum()
            kl = (pref * (ref - logp[k])).sum()
            agree = (mx.argmax(logp[k], axis=-1) == top).sum()
            acc[k][0] += nll.item()
            acc[k][1] += kl.item()
            acc[k][2] += agree.item()
            acc[k][3] += n
    return acc


def _stats(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def per_window_metrics(acc):
    """{kind: {ppl, kl, top1}} of one window's sums."""
    return {k: {"ppl": math.exp(a[0] / a[3]), "kl": a[1] / a[3], "top1": a[2] / a[3]} for k, a in acc.items()}


def summarize(per_window):
    """Median [min-max] per kind and metric over windows (``per_window``: :func:`per_window_metrics` each)."""
    return {k: {m: _stats([w[k][m] for w in per_window]) for m in ("ppl", "kl", "top1")} for k in per_window[0]}


def paired(per_window):
    """KIVI against mlx-lm's quantized cache at each width both ran: windows where each has the lower
    KL, and the per-window ratio KL(mlx-q) / KL(kivi) (above 1: KIVI is closer to the fp cache)."""
    out = {}
    for k in per_window[0]:
        other = "mlx-q" + k.removeprefix("kivi")
        if not k.startswith("kivi") or other not in per_window[0]:
            continue
        ratio = [w[other]["kl"] / w[k]["kl"] for w in per_window if w[k]["kl"] > 0]
        out[f"{k} vs {other}"] = {"kivi_lower_kl": sum(w[k]["kl"] < w[other]["kl"] for w in per_window),
                                  "windows": len(per_window), "kl_ratio": _stats(ratio) if ratio else None}
    return out


def text_windows(tokenizer, which, n, length):
    """Token windows of ``which`` text and what the result records about it."""
    if which == "corpus":
        from vqpipe.text import CORPUS, corpus_windows

        return corpus_windows(tokenizer, n, length), {"text": "corpus", "file": CORPUS.name, "real": False}
    from vqpipe import text

    return text.eval_windows(tokenizer, n, length, which), {"text": which, "real": True, **text.provenance()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench_kivi_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face layout model directory")
    p.add_argument("--out", required=True)
    p.add_argument("--text", default="eval", choices=("eval", "calibration", "all", "corpus"),
                   help="the text the windows come from (default: eval, real English)")
    p.add_argument("--dtype", default="model", choices=("model", "float32", "bfloat16", "float16"),
                   help="cast the model's floating weights, so its activations and the fp cache take this "
                        "dtype (default: as stored; on the CPU float32 is the fast one)")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--kinds", nargs="+", default=["fp", "kivi4", "mlx-q4", "kivi2", "mlx-q2"])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.kinds[0] != "fp":
        args.kinds = ["fp"] + [k for k in args.kinds if k != "fp"]
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, tokenizer = load(args.model)
    if args.dtype != "model":
        from vqpipe.stages.bench_decode import cast_floating

        cast_floating(model, getattr(mx, args.dtype))
    windows, source = text_windows(tokenizer, args.text, args.windows, args.length)
    per_window = []
    dtype = str(next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)))
    for i, ids in enumerate(windows):
        per_window.append(per_window_metrics(window(model, ids.tolist(), args.kinds, args.chunk)))
        print(f"window {i}: " + "; ".join(f"{k} ppl {m['ppl']:.3f} KL {m['kl']:.4f} top1 {m['top1']:.3f}"
                                       for k, m in per_window[-1].items()), flush=True)
        # after every window (a window of five caches takes minutes on the CPU): a run cut short keeps them
        result = {"kind": "bench-kivi-quality", "config": vars(args), "source_text": source, "weights_dtype": dtype,
                  "windows_done": len(per_window), "results": summarize(per_window), "paired": paired(per_window),
                  "windows": per_window}
        write_json(args.out, result)
    for name, c in result["paired"].items():
        r = c["kl_ratio"]
        print(f"{name}: KIVI has the lower KL in {c['kivi_lower_kl']}/{c['windows']} windows"
              + (f", KL ratio median {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]" if r else ""))
    print(f"bench-kivi-quality: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
