"""KL(source || artifact) on calibration-split windows the calibrate stage did not draw (held out)."""
import json, sys
import mlx.core as mx, mlx.nn as nn, numpy as np
from vqpipe import text
from vqpipe.quant import tune as T
from vqpipe.stages.bench_quality import load_source
from vqpipe.store.quantized import load_quantized

src, out, arts = sys.argv[1], sys.argv[2], sys.argv[3:]
source, tok = load_source(src)
teacher = T.teacher_of(source)
models = {a: load_quantized(a)[0] for a in arts}
ids = np.asarray(text.tokens(tok, "calibration"), dtype=np.int32)
L = 512
slots = len(ids) // L
used = set(np.random.default_rng(0).choice(slots, 64, replace=False).tolist())
free = [s for s in range(slots) if s not in used]
pick = [free[i] for i in np.linspace(0, len(free) - 1, 20).astype(int)]
print("calibration tokens", len(ids), "slots", slots, "held-out slots", len(free), "picked", pick, flush=True)
rec = {a: [] for a in arts}
for s in pick:
    w = mx.array(ids[s * L:(s + 1) * L])
    x = w[None]
    pr, ne = T.target(teacher(x))
    for a, m in models.items():
        lq = nn.log_softmax(m(x).astype(mx.float32), axis=-1)
        rec[a].append(mx.mean(ne - mx.sum(pr * lq, axis=-1)).item())
for a in arts:
    print(a, "median KL", round(float(np.median(rec[a])), 5))
r = sorted(x / y for x, y in zip(rec[arts[1]], rec[arts[0]]))
print("ratio second/first median", round(float(np.median(r)), 4), "[", round(r[0], 4), "-", round(r[-1], 4), "]",
      sum(x < 1 for x in r), "/", len(r), "lower")
json.dump(rec, open(out, "w"), indent=1)
