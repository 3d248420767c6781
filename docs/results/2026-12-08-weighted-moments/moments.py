"""Token-weighted moments: a calibrate artifact whose H for each linear is sum_t a_t x_t x_t^T, with
a_t = sum_o (dL/dy_{t,o})^2 of that linear's output (normalised to mean 1 over the tokens), so
GPTQ's error tr(E H E^T) weighs a token by how much the loss reads that layer's output there.
Rank-1 model of the Fisher: g^2_{t,o} ~ a_t b_o; the allocator's per-output b_o stays the
output_fisher's mean g^2 (here from every window).

usage: python experiments/weighted/moments.py SOURCE OUT [--windows 64] [--plain-weights]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from vqpipe import __version__
from vqpipe.quant import recipe
from vqpipe.quant.calibrate import calibration_tokens, tied_head
from vqpipe.quant.recipe import LOOKUP, _dense_table, _output_shapes
from vqpipe.store import record
from vqpipe.store.calibration import FISHER
from vqpipe.store.fsutil import atomic_dir, save_safetensors


class Tap(nn.Module):
    def __init__(self, inner, name, probes, seen):
        super().__init__()
        self.inner, self._name, self._probes, self._seen = inner, name, probes, seen

    def __call__(self, x):
        if isinstance(self.inner, nn.Embedding):
            y = self.inner(x).astype(mx.float32)
            key = self._name + LOOKUP
            return y + self._probes[key] if key in self._probes else y
        self._seen[self._name] = x
        y = self.inner(x).astype(mx.float32)
        return y + self._probes[self._name] if self._name in self._probes else y

    def as_linear(self, x):
        self._seen[self._name] = x
        y = self.inner.as_linear(x)
        return y + self._probes[self._name] if self._name in self._probes else y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--use", type=int, default=0, help="weigh only the first USE of the windows (0: all)")
    p.add_argument("--plain-weights", action="store_true", help="a_t = 1 (the plain moments, as a check)")
    p.add_argument("--clip", type=float, default=0.0, help="cap a_t at this multiple of its mean (0: none)")
    a = p.parse_args()
    from mlx_lm.utils import load as load_model

    t0 = time.perf_counter()
    model, tok = load_model(a.source, lazy=True)
    tokens, calib = calibration_tokens(tok, "text", a.windows, 512, 0, model)
    if a.use:
        tokens = tokens[: a.use]
    model.set_dtype(mx.float32)
    names = recipe.sensitive_layers(model)
    modules = dict(model.named_modules())
    shapes = _output_shapes(model, names, tokens.shape[1] - 1)
    probes, seen = {}, {}
    model.update_modules(tree_unflatten([(n, Tap(modules[n], n, probes, seen)) for n in names]))
    hs, fsum, stats = {}, {}, {}
    tables = {}
    for i in range(tokens.shape[0]):
        x = tokens[i: i + 1]
        zeros = {k: mx.zeros(s, dtype=mx.float32) for k, s in shapes.items()}

        def loss(ps):
            probes.clear()
            probes.update(ps)
            logits = model(x[:, :-1]).astype(mx.float32)
            return nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")

        grads = mx.grad(loss)(zeros)
        probes.clear()
        seen.clear()
        model(x[:, :-1])  # the inputs, outside the transformation
        for k, g in grads.items():
            g = g[0]
            if k.endswith(LOOKUP):
                name = k[: -len(LOOKUP)]
                if name not in tables:
                    tables[name] = _dense_table(modules[name])
                rows = tables[name][x[0, :-1]]
                s = mx.sum(mx.sum(g * g, axis=-1) * mx.sum(rows * rows, axis=-1)) / rows.shape[1]
                fsum[k] = fsum.get(k, 0) + np.float64(s.item())
                continue
            g2 = g * g
            fsum[k] = fsum.get(k, 0) + np.asarray(mx.sum(g2, axis=0), dtype=np.float64)
            w = mx.sum(g2, axis=-1)  # [t]
            if a.plain_weights:
                w = mx.ones_like(w)
            elif a.clip:
                w = mx.minimum(w, a.clip * mx.mean(w))
            pos = int(mx.argmax(w).item())
            stats.setdefault("_argmax", {}).setdefault(k, []).append(pos)
            xin = seen[k][0].astype(mx.float32)  # [t, d]
            xw = xin * mx.sqrt(w)[:, None]
            mx.eval(xw, w)
            arr = np.asarray(xw)
            prod = arr.T @ arr
            hs[k] = hs.get(k, 0) + prod
            st = stats.setdefault(k, [0.0, 0.0, []])
            wn = np.asarray(w, dtype=np.float64)
            st[0] += wn.sum()
            st[1] += len(wn)
            st[2].append(float(wn.max()))
        print(f"[window {i + 1}/{tokens.shape[0]}] {time.perf_counter() - t0:.0f}s", flush=True)
    model.update_modules(tree_unflatten([(n, modules[n]) for n in names]))
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    T = tokens.size
    tensors, layers, spread = {}, {}, {}
    argmax = stats.pop("_argmax")
    zero = sum(p == 0 for v in argmax.values() for p in v) / sum(len(v) for v in argmax.values())
    print(f"the heaviest token is the window's first in {zero:.1%} of (layer, window)")
    for k, h in hs.items():
        mean = stats[k][0] / stats[k][1]
        # scaled so that the weights average 1 over the predicted tokens, and the H sums over T
        # tokens as the plain moments do
        hs_k = h / mean * (T / count)
        tensors[k] = mx.array(hs_k.astype(np.float32))
        layers[k] = k
        spread[k] = {"max_over_mean": max(stats[k][2]) / mean}
    for k, v in fsum.items():
        f = v / count * (T if k.endswith(LOOKUP) else 1)
        tensors[FISHER + k] = mx.array(np.asarray(f, dtype=np.float32))
    info = {"vqpipe_version": __version__, "source": a.source, "calibration": {**calib, "sequential": False,
            "weighted": not a.plain_weights, "clip": a.clip},
            "layers": layers, "sets": [{"residual_rotation": None, "prefix": "", "layers": layers}],
            "seconds": time.perf_counter() - t0,
            "sensitivity": {"windows": tokens.shape[0], "loss": "next-token NLL", "lookup_tokens": T},
            "spread": spread}
    with atomic_dir(a.out, manifest=True) as tmp:
        save_safetensors(tmp / "moments.safetensors", tensors)
        record.write(tmp / "moments.json", "calibrate", info, inputs={"source": Path(a.source)})
    worst = sorted(spread.items(), key=lambda kv: -kv[1]["max_over_mean"])[:8]
    print("largest max/mean token weight:", [(k, round(v["max_over_mean"], 1)) for k, v in worst])
    print(f"done in {time.perf_counter() - t0:.0f}s -> {a.out}")


if __name__ == "__main__":
    sys.exit(main())
