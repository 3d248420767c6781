import json
from collections import defaultdict
import mlx_lm
from vqpipe.quant import quantize, recipe
from vqpipe.store import calibration as cal
S = "/work/main/results/models/smollm2/source"
C = "/work/main/results/calibration/smollm2"
model, _ = mlx_lm.load(S, lazy=True)
moments, _ = cal.load(C)
fisher = cal.load_fisher(C)
targets = [(n, k) for n, _, k in quantize._targets(model, True, True)]
rot = lambda name, dim: quantize.layer_rotation("auto", 0, name, dim)
chosen, tables, weights = recipe.plan(model, 2, targets, moments, fisher, 2.5, rot, None, None, "trellis")
def group(n):
    for g, keys in (("embed/head", ["embed_tokens"]), ("attn q,k,v", ["q_proj", "k_proj", "v_proj"]), ("attn o", ["o_proj"]),
                    ("mlp gate,up", ["gate_proj", "up_proj"]), ("mlp down", ["down_proj"])):
        if any(k in n for k in keys):
            return g
pred = defaultdict(float); pred2 = defaultdict(float); bits = defaultdict(float); cnt = defaultdict(int)
for n, w in chosen.items():
    g = group(n); pred[g] += tables[n][w][1]; pred2[g] += tables[n][2][1]; bits[g] += tables[n][w][0]; cnt[g] += 1
for g in pred:
    print(f"{g:12s} layers {cnt[g]:3d} predicted loss at chosen {pred[g]:.4f}  at 2 bits {pred2[g]:.4f}  bits {bits[g]/1e6:.1f}M")
emb = [n for n in chosen if "embed" in n][0]
print(emb, {w: (round(t[0]/1e6, 2), round(t[1], 4)) for w, t in tables[emb].items()})
print("fisher lookup", fisher.get(emb + recipe.LOOKUP))
