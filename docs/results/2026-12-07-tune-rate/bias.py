"""Tuning a bias per output row beside the row scales (2-bit SmolLM2), against scales only.

Both arms start from the pipeline's tuned b2-auto artifact and run 32 more Adam steps on
calibration pieces the first tuning did not read; the held-out calibration pieces (the ones
vqpipe.quant.tune holds out) decide; the evaluation texts are reported, never used to choose.
"""
import argparse, json, sys, time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten, tree_flatten

from vqpipe import text
from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear
from vqpipe.quant import tune as T
from vqpipe.quant.cpu_eval import window_logprobs  # noqa: F401  (not used; the plain forward is)
from vqpipe.stages.bench_quality import load_source
from vqpipe.store.quantized import load_quantized

p = argparse.ArgumentParser()
p.add_argument("--arm", choices=["scales", "bias", "none"], required=True)
p.add_argument("--steps", type=int, default=32)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--eval-windows", type=int, default=20)
p.add_argument("--out", required=True)
a = p.parse_args()

src = "results/models/smollm2/source"
art = "results/quantized/smollm2/b2-auto"
source, tok = load_source(src)
teacher = T.teacher_of(source)
model, _ = load_quantized(art)
tokens = text.calibration_tokens(tok, 64, 512, seed=0)
pieces = T.windows(tokens, 256)
n = pieces.shape[0]
first = [(i * n) // 32 for i in range(32)]
unused = [i for i in range(n) if i not in set(first)]
held = [unused[(j * len(unused)) // T.HELD] for j in range(T.HELD)]
train = [i for i in unused if i not in held][:: max(1, (len(unused) - T.HELD) // a.steps)][: a.steps]

layers = {k: m for k, m in model.named_modules() if isinstance(m, QuantizedLinear)}
inside = tuple(k + "." for k in layers)
rest = [(k, v) for k, v in tree_flatten(model.parameters()) if not k.startswith(inside) and mx.issubdtype(v.dtype, mx.floating)]
model.load_weights([(k, v.astype(mx.float32)) for k, v in rest], strict=False)


class Biased(T._Scaled):
    def __init__(self, layer):
        super().__init__(layer)
        self.b = mx.zeros((layer.out_features,), dtype=mx.float32)

    def __call__(self, x):
        return super().__call__(x) + self.b


class BiasedEmb(T._ScaledEmbedding):
    pass  # the embedding: a lookup; a bias there would be a constant added to every token's row


mk = {"scales": (T._Scaled, T._ScaledEmbedding), "bias": (Biased, BiasedEmb), "none": (T._Scaled, T._ScaledEmbedding)}[a.arm]
scaled = {k: (mk[1] if isinstance(m, QuantizedEmbedding) else mk[0])(m) for k, m in layers.items()}
model.update_modules(tree_unflatten(list(scaled.items())))
model.freeze()
for m in scaled.values():
    m.unfreeze(keys=["d", "b"] if isinstance(m, Biased) else ["d"], recurse=False)
mx.eval(model.parameters())
targets = [(pieces[i][None], *T.target(teacher(pieces[i][None]))) for i in held]


def held_kl():
    return sum(T.kl_to(model, *t).item() for t in targets) / len(targets)


def snapshot():
    return {k: dict(d=m.d, **({"b": m.b} if isinstance(m, Biased) else {})) for k, m in scaled.items()}


rec = {"arm": a.arm, "steps": a.steps, "lr": a.lr, "train": train, "held": held, "checks": []}
t0 = time.perf_counter()
best = (0, held_kl(), snapshot())
rec["checks"].append([0, best[1]])
print(a.arm, "held before", best[1], flush=True)
if a.arm != "none":
    fn = nn.value_and_grad(model, T.kl_to)
    opt = optim.Adam(learning_rate=a.lr)
    for s, i in enumerate(train, 1):
        x = pieces[i][None]
        loss, g = fn(model, x, *T.target(teacher(x)))
        opt.update(model, g)
        mx.eval(model.trainable_parameters(), opt.state, loss)
        if s % 8 == 0:
            h = held_kl()
            rec["checks"].append([s, h])
            print(a.arm, s, "loss", loss.item(), "held", h, f"{time.perf_counter() - t0:.0f}s", flush=True)
            if h < best[1]:
                best = (s, h, snapshot())
for k, m in scaled.items():
    m.d = best[2][k]["d"]
    if "b" in best[2][k]:
        m.b = best[2][k]["b"]
rec["best_step"], rec["held_best"] = best[0], best[1]
if a.arm == "bias":
    bs = mx.concatenate([m.b for m in scaled.values() if isinstance(m, Biased)])
    rec["bias_absmax"] = mx.abs(bs).max().item()

# evaluation texts: KL(source || arm) per window, median; perplexity over the windows
for corpus in ("devil", "jargon"):
    ws = text.eval_windows(tok, a.eval_windows, 512, corpus=corpus)
    kls, nll, cnt = [], 0.0, 0
    for w in ws:
        x = w[None]
        p, ne = T.target(teacher(x))
        lq = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
        kl = mx.mean(ne - mx.sum(p * lq, axis=-1)).item()
        kls.append(kl)
        tgt = w[1:]
        nll += -mx.take_along_axis(lq[0, :-1], tgt[:, None], axis=-1).sum().item()
        cnt += tgt.shape[0]
    rec[corpus] = {"kl_median": float(np.median(kls)), "kl": kls, "ppl": float(np.exp(nll / cnt))}
    print(a.arm, corpus, rec[corpus]["kl_median"], rec[corpus]["ppl"], flush=True)
rec["seconds"] = time.perf_counter() - t0
json.dump(rec, open(a.out, "w"), indent=1)
