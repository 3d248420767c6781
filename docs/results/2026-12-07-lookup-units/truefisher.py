"""Predicted per-group loss with the empirical Fisher (true next tokens) and the true Fisher (labels
sampled from the source's own distribution), at the b2-auto widths."""
import sys
from collections import defaultdict
import numpy as np
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from vqpipe.quant import quantize, recipe
from vqpipe.store import calibration as cal
from vqpipe import text
S = "/work/main/results/models/smollm2/source"
C = "/work/main/results/calibration/smollm2"
model, tok = mlx_lm.load(S)
moments, _ = cal.load(C)
emp = cal.load_fisher(C)
from vqpipe.quant.calibrate import calibration_tokens
tokens, _ = calibration_tokens(tok, "text", 64, 512, 0, model)
tokens = mx.array(np.asarray(tokens))[:recipe.FISHER_WINDOWS]
orig = nn.losses.cross_entropy
key = [mx.random.key(0)]
def sampled(logits, targets, reduction="none"):
    key[0], k = mx.random.split(key[0])
    y = mx.stop_gradient(mx.random.categorical(logits, key=k))  # one label per position from the model
    return orig(logits, y, reduction="sum")
nn.losses.cross_entropy = sampled
true = recipe.output_fisher(model, tokens, recipe.sensitive_layers(model))
nn.losses.cross_entropy = orig
targets = [(n, k) for n, _, k in quantize._targets(model, True, True)]
rot = lambda name, dim: quantize.layer_rotation("auto", 0, name, dim)
def group(n):
    for g, keys in (("embed/head", ["embed_tokens"]), ("attn q,k,v", ["q_proj", "k_proj", "v_proj"]), ("attn o", ["o_proj"]),
                    ("mlp gate,up", ["gate_proj", "up_proj"]), ("mlp down", ["down_proj"])):
        if any(k in n for k in keys):
            return g
ref_choice, _, _ = recipe.plan(model, 2, targets, moments, emp, 2.5, rot, None, None, "trellis")
for label, f in (("empirical", emp), ("true", true)):
    chosen, tables, _ = recipe.plan(model, 2, targets, moments, f, 2.5, rot, None, None, "trellis")
    pred = defaultdict(float); tot = 0
    for n, w in ref_choice.items():
        pred[group(n)] += tables[n][w][1]; tot += tables[n][w][1]
    print(label, {g: round(v / tot, 3) for g, v in pred.items()})
    from collections import Counter
    c = defaultdict(Counter)
    for n, w in chosen.items():
        c[group(n)][w] += 1
    print("  its allocation:", {g: dict(v) for g, v in c.items()})
    if label == "true":
        np.savez("/tmp/attr/true_fisher.npz", **{k: np.asarray(v) for k, v in f.items()})
