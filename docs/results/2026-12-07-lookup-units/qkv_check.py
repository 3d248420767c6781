"""Does a layer's predicted loss (g_o averaged over tokens times the error variance averaged over
tokens) match the per-token sum E_t[sum_o g_to^2 dy_to^2]? Per layer kind, on held-out calibration
windows, with the pipeline's 2-bit weights' actual errors."""
import sys
from collections import defaultdict
import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from vqpipe import text
from vqpipe.stages import bench_quality as bq

S, Q = sys.argv[1], sys.argv[2]
src, tok = bq.load_source(S)
qm, _, _ = bq.vqpipe_arm(S, 2, "auto", 0, quantized=Q)
qm = bq.dense_copy(qm)
Wq = dict(tree_flatten(qm.parameters()))
mods = dict(src.named_modules())
names = [n for n, m in mods.items() if isinstance(m, nn.Linear) and n.startswith("model.layers.")
         and int(n.split(".")[2]) in (2, 9, 15, 22, 28)]
ids = np.asarray(text.tokens(tok, "calibration"), dtype=np.int32)
L = 512
used = set(np.random.default_rng(0).choice(len(ids) // L, 64, replace=False).tolist())
free = [s for s in range(len(ids) // L) if s not in used][:3]

class Rec(nn.Module):
    def __init__(self, inner, name, store, probes):
        super().__init__()
        self.inner, self._n, self._s, self._p = inner, name, store, probes
    def __call__(self, x):
        if self._s is not None:
            self._s[self._n] = x
        y = self.inner(x)
        return y + self._p[self._n] if self._n in self._p else y

store, probes = {}, {}
src.update_modules(tree_unflatten([(n, Rec(mods[n], n, store, probes)) for n in names]))
acc = defaultdict(lambda: [0.0, 0.0, 0.0, 0])  # kind -> [actual, factorized parts...]
res = defaultdict(list)
for s in free:
    x = mx.array(ids[s * L:(s + 1) * L])[None]
    store.clear()
    src(x[:, :-1])
    xs = {n: store[n][0] for n in names}
    mx.eval(xs)
    for r in src.modules():
        if isinstance(r, Rec):
            r._s = None
    zeros = {n: mx.zeros((1, L - 1, mods[n].weight.shape[0])) for n in names}
    def loss(ps):
        probes.clear(); probes.update(ps)
        return nn.losses.cross_entropy(src(x[:, :-1]), x[:, 1:], reduction="sum")
    g = mx.grad(loss)(zeros)
    probes.clear()
    for r in src.modules():
        if isinstance(r, Rec):
            r._s = store
    for n in names:
        e = Wq[n + ".weight"] - mods[n].weight
        dy = xs[n] @ e.T  # [T, out]
        gg = g[n][0] ** 2
        actual = mx.mean(mx.sum(gg * dy * dy, axis=-1)).item()
        fact = mx.sum(mx.mean(gg, axis=0) * mx.mean(dy * dy, axis=0)).item()
        res[n.split(".")[-1]].append(actual / fact)
for k, v in res.items():
    print(f"{k:10s} actual / factorized: median {np.median(v):.3f} [{min(v):.3f}-{max(v):.3f}] n={len(v)}")
