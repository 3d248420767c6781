"""Tuning's Adam rate: constant (the default) against a cosine decay to a tenth, from the untuned
artifact (quantize --tune-steps 0), the pipeline's 32 steps x 256 tokens and held-out checks; then
KL(source || arm) on 20 x 512 windows of each evaluation text (reported, never used to choose)."""
import argparse, json, time
import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim, numpy as np
from vqpipe import text
from vqpipe.quant import tune as T
from vqpipe.stages.bench_quality import load_source
from vqpipe.store.quantized import load_quantized

p = argparse.ArgumentParser()
p.add_argument("--artifact", required=True)
p.add_argument("--schedule", choices=["const", "cos"], required=True)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--out", required=True)
a = p.parse_args()
source, tok = load_source("results/models/smollm2/source")
teacher = T.teacher_of(source)
model, _ = load_quantized(a.artifact)
tokens = text.calibration_tokens(tok, 64, 512, seed=0)
lr = a.lr if a.schedule == "const" else optim.cosine_decay(a.lr, 32, a.lr / 10)
t0 = time.perf_counter()
rec = T.tune(model, teacher, tokens, 32, lr=lr, length=256, progress=lambda s: print(s, flush=True))
rec["lr"] = f"{a.schedule} {a.lr}"
for corpus in ("devil", "jargon"):
    kls, nll, cnt = [], 0.0, 0
    for w in text.eval_windows(tok, 20, 512, corpus=corpus):
        x = w[None]
        pr, ne = T.target(teacher(x))
        lq = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
        kls.append(mx.mean(ne - mx.sum(pr * lq, axis=-1)).item())
        nll += -mx.take_along_axis(lq[0, :-1], w[1:, None], axis=-1).sum().item()
        cnt += w.shape[0] - 1
    rec[corpus] = {"kl_median": float(np.median(kls)), "kl": kls, "ppl": float(np.exp(nll / cnt))}
    print(a.schedule, corpus, rec[corpus]["kl_median"], rec[corpus]["ppl"], flush=True)
rec["all_seconds"] = time.perf_counter() - t0
json.dump(rec, open(a.out, "w"), indent=1)
