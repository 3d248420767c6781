"""bench-kivi-quality: long-context quality of KIVI caches against the full-precision cache.

Windows of the shipped English corpus (vqpipe/data/corpus.txt, spread over it). Each window of
``--length`` tokens runs through the model in ``--chunk``-token pieces, once per
cache kind, all kinds chunk by chunk side by side; per kind: perplexity of the window's next
tokens, mean KL(full-precision cache || kind) over positions, and top-1 agreement with the
full-precision cache. Kinds: ``fp`` (mlx-lm's KVCache at the model dtype), ``kivi<b>`` (the packed
KIVI cache, G = 32, R = 128; keys per channel, values per token) and ``mlx-q<b>`` (mlx-lm's
QuantizedKVCache: keys and values per token, affine, group 64, no full-precision residual).
Chunked processing means a chunk attends to what each cache holds after storing it, as in
generation with that prefill step.

    python -m vqpipe bench-kivi-quality --model DIR --text eval --out results/bench/kivi_quality.json
"""

import argparse
import math
import statistics
import sys

import mlx.core as mx

from ..fsutil import write_json
from ..kivi.cache import make_kivi_cache


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


def summarize(per_window):
    out = {}
    for k in per_window[0]:
        ppl = [math.exp(w[k][0] / w[k][3]) for w in per_window]
        kl = [w[k][1] / w[k][3] for w in per_window]
        top = [w[k][2] / w[k][3] for w in per_window]
        out[k] = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                  for name, v in (("ppl", ppl), ("kl", kl), ("top1", top))}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe bench-kivi-quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face layout model directory")
    p.add_argument("--out", required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--kinds", nargs="+", default=["fp", "kivi4", "mlx-q4", "kivi2", "mlx-q2"])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.kinds[0] != "fp":
        args.kinds = ["fp"] + [k for k in args.kinds if k != "fp"]
    from mlx_lm import load

    from .bench_quality import CORPUS, eval_windows

    model, tokenizer = load(args.model)
    windows = [w.tolist() for w in eval_windows(tokenizer, args.windows, args.length)]
    per_window = []
    for i, ids in enumerate(windows):
        per_window.append(window(model, ids, args.kinds, args.chunk))
        print(f"window {i}: " + "; ".join(f"{k} ppl {math.exp(a[0] / a[3]):.3f} KL {a[1] / a[3]:.4f} top1 {a[2] / a[3]:.3f}"
                                       for k, a in per_window[-1].items()), flush=True)
    result = {"kind": "bench-kivi-quality", "config": vars(args), "text": str(CORPUS.name), "results": summarize(per_window)}
    write_json(args.out, result)
    print(f"bench-kivi-quality: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
