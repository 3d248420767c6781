from collections import defaultdict, Counter
import mlx_lm
from vqpipe.quant import quantize, recipe
from vqpipe.store import calibration as cal
S = "/work/main/results/models/smollm2/source"; C = "/work/main/results/calibration/smollm2"
model, _ = mlx_lm.load(S, lazy=True)
moments, _ = cal.load(C); fisher = cal.load_fisher(C)
targets = [(n, k) for n, _, k in quantize._targets(model, True, True)]
rot = lambda name, dim: quantize.layer_rotation("auto", 0, name, dim)
def group(n):
    for g, keys in (("embed", ["embed_tokens"]), ("qkv", ["q_proj", "k_proj", "v_proj"]), ("o", ["o_proj"]),
                    ("gate,up", ["gate_proj", "up_proj"]), ("down", ["down_proj"])):
        if any(k in n for k in keys):
            return g
fixed = {k: (v * 64 * 512 if k.endswith(recipe.LOOKUP) else v) for k, v in fisher.items()}
for bits in (2, 3, 4):
    for label, f in (("now", fisher), ("fixed", fixed)):
        chosen, tables, w = recipe.plan(model, bits, targets, moments, f, bits + 0.5, rot, None, None, "trellis")
        c = defaultdict(Counter)
        for n, x in chosen.items():
            c[group(n)][x] += 1
        print(bits, label, {g: dict(sorted(v.items())) for g, v in c.items()}, flush=True)
