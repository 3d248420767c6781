"""Where the 2-bit model's KL comes from, per text: the quantized model with one group of matrices
given back their source weights (dense float32), KL(source || hybrid) on both evaluation texts."""
import json, sys, time
import mlx.core as mx
from mlx.utils import tree_flatten
from experiments.vq import smollm2 as S
from vqpipe.stages import bench_quality as bq

ref, quant, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
src, _ = bq.load_source(S.SOURCE)
Ws = dict(tree_flatten(src.parameters()))
qm, _, _ = bq.vqpipe_arm(S.SOURCE, 2, "auto", 0, quantized=quant)
qm = bq.dense_copy(qm)
Wq = dict(tree_flatten(qm.parameters()))
assert Ws.keys() == Wq.keys(), set(Ws) ^ set(Wq)
differ = sorted(k for k in Ws if Ws[k].shape != Wq[k].shape or not mx.array_equal(Ws[k], Wq[k]).item())
print(len(differ), "arrays differ;", [k for k in differ if not k.endswith(".weight") or "norm" in k][:8], flush=True)
L = 30
groups = {
    "none": [],
    "embed/head": [k for k in differ if "embed_tokens" in k],
    "attn q,k,v": [k for k in differ if any(p in k for p in ("q_proj", "k_proj", "v_proj"))],
    "attn o": [k for k in differ if "o_proj" in k],
    "mlp gate,up": [k for k in differ if any(p in k for p in ("gate_proj", "up_proj"))],
    "mlp down": [k for k in differ if "down_proj" in k],
    "blocks 0-9": [k for k in differ if k.startswith("model.layers.") and int(k.split(".")[2]) < 10],
    "blocks 10-19": [k for k in differ if k.startswith("model.layers.") and 10 <= int(k.split(".")[2]) < 20],
    "blocks 20-29": [k for k in differ if k.startswith("model.layers.") and int(k.split(".")[2]) >= 20],
}
res = {}
for g, keys in groups.items():
    t0 = time.time()
    qm.update(__import__("mlx.utils", fromlist=["tree_unflatten"]).tree_unflatten(
        [(k, Ws[k] if k in keys else Wq[k]) for k in differ]))
    mx.eval(qm.parameters())
    r = S.evaluate(qm, ref, n, 512)
    res[g] = {t: {"kl": v["kl"], "kl_mean": v["kl_mean"], "per_window": v["per_window"]["kl"]} for t, v in r.items()}
    print(g, len(keys), {t: round(v["kl"]["median"], 4) for t, v in r.items()}, f"{time.time()-t0:.0f}s", flush=True)
    json.dump(res, open(out, "w"), indent=1)
