"""bench-kv-quality: what a quantized KV cache costs in quality and saves in memory, on a real model.

Windows of real English text (the eval split of ``--text``), evenly spread over it. Each window of
``--length`` tokens runs through the model in ``--chunk``-token pieces once per cache kind, all
kinds chunk by chunk side by side, so a chunk attends to what each cache holds after storing the
chunks before it (as generation with that prefill step does). Per kind and window: perplexity of
the next tokens, mean KL(full-precision cache || kind) over positions, top-1 agreement with the
full-precision cache, and the cache's resident bytes per token at the window's end.

Kinds: ``fp`` (mlx-lm's KVCache at the model's activation dtype: the reference), ``kivi<b>`` (what
``vqpipe generate --kv-bits b`` and ``make_kivi_cache`` use: the packed KIVI cache, G = 32, R = 128,
keys per channel, values per token) and ``mlx-q<b>`` (mlx-lm's QuantizedKVCache: keys and values per
token, affine, group 64, no full-precision window: what ``mlx_lm.generate --kv-bits b`` uses). The
fp16 size of the same tokens is computed from the cache geometry, the yardstick of the memory
column. Where ``kivi<b>`` and ``mlx-q<b>`` both ran, ``paired`` says in how many windows KIVI has
the lower KL and the median per-window KL ratio.

    vqpipe bench-kv-quality --model-dir results/reservoir/smollm2/b4-auto/persist-off --model smollm2 \\
        --out results/bench/smollm2/kv_quality.json
"""

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from .. import text
from ..bench.dtype import cast_floating
from ..bench.env import environment
from ..bench import harness
from ..kernels import dequant
from ..kivi import make_kivi_cache
from ..store import record

KINDS = ("fp", "kivi4", "mlx-q4", "kivi2", "mlx-q2")
GROUP, RESIDUAL, MLX_GROUP = 32, 128, 64


def kind_bits(kind):
    """Bits of a quantized kind (``kivi4`` -> 4, ``mlx-q2`` -> 2); a clear error for a bad name."""
    if kind == "fp":
        return None
    prefix = "mlx-q" if kind.startswith("mlx-q") else "kivi" if kind.startswith("kivi") else None
    bits = kind.removeprefix(prefix) if prefix else ""
    if not bits.isdigit() or int(bits) not in (2, 4, 8):
        raise ValueError(f"bench-kv-quality: unknown cache kind {kind!r}: one of fp, kivi2/4/8, mlx-q2/4/8")
    return int(bits)


def make_cache(model, kind):
    bits = kind_bits(kind)
    if bits is None:
        return make_prompt_cache(model)
    if kind.startswith("mlx-q"):
        return [QuantizedKVCache(group_size=MLX_GROUP, bits=bits) for _ in model.layers]
    return make_kivi_cache(model, bits, GROUP, RESIDUAL)


def cache_nbytes(caches):
    """Resident bytes of a prompt cache (every layer's buffers as allocated)."""
    return sum(c.nbytes for c in caches)


def fp16_nbytes(caches, tokens):
    """What ``tokens`` positions take in a float16 cache of the model's geometry (keys and values,
    every layer), from the fp cache's buffers' shapes."""
    total = 0
    for c in caches:
        k, v = c.keys, c.values
        total += 2 * tokens * k.shape[1] * (k.shape[3] + v.shape[3])
    return total


def window(model, ids, kinds, chunk):
    """Per kind: the window's sums (NLL, KL vs fp, top-1 agreements, positions) and its cache's
    resident bytes at the end; and the fp16 size of the window."""
    caches = {k: make_cache(model, k) for k in kinds}
    acc = {k: [0.0, 0.0, 0, 0] for k in kinds}
    for a in range(0, len(ids) - 1, chunk):
        x = mx.array(ids[a:a + chunk])[None]
        target = mx.array(ids[a + 1:a + 1 + chunk])
        n = target.shape[0]
        logp = {}
        for k in kinds:
            out = model(x, cache=caches[k])[0, :n].astype(mx.float32)
            logp[k] = out - mx.logsumexp(out, axis=-1, keepdims=True)
            mx.eval(logp[k], [c.state for c in caches[k]])
        ref = logp["fp"]
        pref, top = mx.exp(ref), mx.argmax(ref, axis=-1)
        for k in kinds:
            nll = -mx.take_along_axis(logp[k], target[:, None], axis=-1).sum()
            kl = (pref * (ref - logp[k])).sum()
            agree = (mx.argmax(logp[k], axis=-1) == top).sum()
            acc[k][0] += nll.item()
            acc[k][1] += kl.item()
            acc[k][2] += agree.item()
            acc[k][3] += n
    metrics = {k: {"ppl": math.exp(s[0] / s[3]), "kl": s[1] / s[3], "top1": s[2] / s[3],
                   "bytes_per_token": cache_nbytes(caches[k]) / len(ids)} for k, s in acc.items()}
    return metrics, fp16_nbytes(caches["fp"], len(ids)) / len(ids)


def summarize(per_window):
    """Median [min-max] per kind and metric over windows."""
    return {k: {m: harness.summarize([w[k][m] for w in per_window]) for m in ("ppl", "kl", "top1", "bytes_per_token")}
            for k in per_window[0]}


def paired(per_window):
    """KIVI against mlx-lm's quantized cache at each width both ran: windows where KIVI has the lower
    KL, and the per-window ratio KL(mlx-q) / KL(kivi) (above 1: KIVI is closer to the fp cache)."""
    out = {}
    for k in per_window[0]:
        other = "mlx-q" + k.removeprefix("kivi")
        if not k.startswith("kivi") or other not in per_window[0]:
            continue
        ratio = [w[other]["kl"] / w[k]["kl"] for w in per_window if w[k]["kl"] > 0]
        out[f"{k} vs {other}"] = {"kivi_lower_kl": sum(w[k]["kl"] < w[other]["kl"] for w in per_window),
                                  "windows": len(per_window), "kl_ratio": harness.summarize(ratio) if ratio else None}
    return out


def load(path):
    """(model, tokenizer, what was loaded): a reservoir through vqpipe.load, else an mlx-lm model."""
    if (Path(path) / "config.json").exists() and not any(Path(path).glob("*.vqres")):
        import mlx_lm

        model, tok = mlx_lm.load(path)
        return model, tok, "mlx-lm model"
    import vqpipe

    model, tok = vqpipe.load(path)
    return model, tok, "vqpipe reservoir"


def parser():
    p = argparse.ArgumentParser(prog="vqpipe bench-kv-quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="a vqpipe reservoir or an mlx-lm model directory")
    p.add_argument("--model", default=None, help="model name recorded in the output")
    p.add_argument("--out", required=True)
    p.add_argument("--text", default="devil", choices=list(text.CORPORA), help="the evaluation text (its eval split)")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--length", type=int, default=2048, help="tokens per window (the context the cache holds)")
    p.add_argument("--chunk", type=int, default=256, help="tokens stored per forward (the prefill step)")
    p.add_argument("--kinds", nargs="+", default=["fp", "kivi4", "mlx-q4"], help=f"cache kinds (from {', '.join(KINDS)})")
    p.add_argument("--dtype", default="auto", choices=("auto", "stored", "float32", "float16", "bfloat16"),
                   help="the model's activations and so its caches' full-precision parts (auto: float32 on the "
                        "CPU, where bfloat16 matmuls are slow; as stored on a GPU)")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:  # bad input: one line naming it (argparse's exit 2), before anything is loaded or written
        for k in args.kinds:
            kind_bits(k)
        if args.chunk < 1 or args.length < 2 or args.windows < 1:
            raise ValueError("--chunk and --windows must be >= 1, --length >= 2")
        if not Path(args.model_dir).is_dir():
            raise ValueError(f"--model-dir {args.model_dir} is not a directory")
    except ValueError as e:
        p.error(str(e).removeprefix("bench-kv-quality: "))
    kinds = ["fp"] + [k for k in dict.fromkeys(args.kinds) if k != "fp"]
    t0 = time.perf_counter()
    model, tok, loaded = load(args.model_dir)
    dtype = {"auto": "float32" if mx.default_device() == mx.cpu else "stored"}.get(args.dtype, args.dtype)
    if dtype != "stored":
        cast_floating(model, getattr(mx, dtype))
    windows = text.eval_windows(tok, args.windows, args.length, corpus=args.text)
    per_window, fp16 = [], []
    # a reservoir's weights decoded once, not per chunk (the caches are what differs between kinds)
    with dequant.decoded_once():
        for i, ids in enumerate(windows):
            metrics, f16 = window(model, ids.tolist(), kinds, args.chunk)
            per_window.append(metrics)
            fp16.append(f16)
            print(f"window {i + 1}/{len(windows)}: " + "; ".join(
                f"{k} ppl {m['ppl']:.3f} KL {m['kl']:.4f} top1 {m['top1']:.3f} {m['bytes_per_token']:.0f} B/token"
                for k, m in metrics.items()), flush=True)
    doc = {"model": args.model, "loaded": loaded, "dtype": dtype, "config": {**vars(args), "kinds": kinds, "kivi_group": GROUP,
                                                              "kivi_residual": RESIDUAL, "mlx_group": MLX_GROUP},
           "source_text": {"corpus": args.text, "split": "eval", **text.provenance(args.text)},
           "results": summarize(per_window), "fp16_bytes_per_token": statistics.median(fp16),
           "paired": paired(per_window), "windows": per_window, "seconds": time.perf_counter() - t0,
           "environment": environment()}
    record.write(args.out, "bench-kv-quality", doc, inputs={"model_dir": args.model_dir})
    for k, r in doc["results"].items():
        print(f"{k}: KL {r['kl']['median']:.4f} [{r['kl']['min']:.4f}-{r['kl']['max']:.4f}], ppl {r['ppl']['median']:.3f}, "
              f"{r['bytes_per_token']['median'] / doc['fp16_bytes_per_token']:.3f}x the fp16 cache's bytes")
    print(f"bench-kv-quality: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
