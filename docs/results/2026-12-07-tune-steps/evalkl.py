"""KL(source || artifact) and perplexity on 20 x 512 windows of each evaluation text (reported only)."""
import json, sys, time
import mlx.core as mx, mlx.nn as nn, numpy as np
from vqpipe import text
from vqpipe.quant import tune as T
from vqpipe.stages.bench_quality import load_source
from vqpipe.store.quantized import load_quantized

src, out, arts = sys.argv[1], sys.argv[2], sys.argv[3:]
source, tok = load_source(src)
teacher = T.teacher_of(source)
models = {a: load_quantized(a)[0] for a in arts}
rec = {a: {} for a in arts}
for corpus in ("devil", "jargon"):
    acc = {a: ([], 0.0, 0) for a in arts}
    for w in text.eval_windows(tok, 20, 512, corpus=corpus):
        x = w[None]
        pr, ne = T.target(teacher(x))
        for a, m in models.items():
            lq = nn.log_softmax(m(x).astype(mx.float32), axis=-1)
            kls, nll, cnt = acc[a]
            kls.append(mx.mean(ne - mx.sum(pr * lq, axis=-1)).item())
            acc[a] = (kls, nll - mx.take_along_axis(lq[0, :-1], w[1:, None], axis=-1).sum().item(), cnt + w.shape[0] - 1)
    for a in arts:
        kls, nll, cnt = acc[a]
        rec[a][corpus] = {"kl_median": float(np.median(kls)), "kl": kls, "ppl": float(np.exp(nll / cnt))}
        print(a, corpus, round(rec[a][corpus]["kl_median"], 4), round(rec[a][corpus]["ppl"], 2), flush=True)
if len(arts) == 2:
    for corpus in ("devil", "jargon"):
        r = sorted(x / y for x, y in zip(rec[arts[1]][corpus]["kl"], rec[arts[0]][corpus]["kl"]))
        print(corpus, "ratio second/first median", round(float(np.median(r)), 4), "[", round(r[0], 4), "-", round(r[-1], 4), "]",
              sum(x < 1 for x in r), "/", len(r), "lower")
json.dump(rec, open(out, "w"), indent=1)
