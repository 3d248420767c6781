# Held-out output error of qwen2.5-0.5b layers: full H-weighted group refit vs block-diagonal refit vs GPTQ's own steps.
import sys, time, numpy as np, mlx.core as mx
from mlx_lm.utils import load
from vqpipe import gptq
from vqpipe.calibrate import collect, decoder, block_forward, _batches
from vqpipe.quantize import layer_rotation
from vqpipe.codebook import codebook
from vqpipe.stages.quantize import calibration_tokens
model, tok = load("results/models/qwen2.5-0.5b/source", lazy=True)
cal, _ = calibration_tokens(tok, "text", 2, 512, 0)
held, _ = calibration_tokens(tok, "text", 4, 512, 7)
inner = decoder(model)
blocks = [int(b) for b in sys.argv[1].split(",")]
def inputs(tokens, upto):
    h = [inner.embed_tokens(b).astype(mx.float32) for b in _batches(tokens)]
    out = {}
    for i, layer in enumerate(inner.layers[: upto + 1]):
        names = [n for n, m in model.named_modules() if n.startswith(f"model.layers.{i}.") and n.count(".") == 4 and n.endswith("proj")]
        stats, h = collect(model, names, block_forward(layer, "causal"), h, lambda name, dim: layer_rotation("auto", 0, name, dim))
        if i in blocks: out[i] = stats
    return out
A, B = inputs(cal, max(blocks)), inputs(held, max(blocks))
def blockdiag_refit(w, c, gs, h):
    n, d = w.shape; G = d // gs
    s = np.empty((n, G), np.float32)
    for g in range(G):
        sl = slice(g * gs, (g + 1) * gs); hg = h[sl, sl]
        y = c[:, sl] @ hg
        s[:, g] = (np.einsum("nk,nk->n", y, w[:, sl], dtype=np.float64) / np.maximum(np.einsum("nk,nk->n", y, c[:, sl], dtype=np.float64), 1e-300))
    return s
tot = {}
for i in blocks:
    for name in ["mlp.down_proj", "mlp.gate_proj", "self_attn.q_proj", "self_attn.o_proj"]:
        full = f"model.layers.{i}.{name}"
        key, hr = A[i][full]; _, hv = B[i][full]
        mod = dict(model.named_modules())[full]
        w = np.array(hr.rotation.apply(mod.weight.astype(mx.float32)))
        d = w.shape[1]; lv = codebook(4, d).astype(np.float32); unit = lv / np.sqrt(d)
        h = np.array(hr.h, np.float32); n = gptq.ldl_factor(h)
        hd = h.copy(); np.fill_diagonal(hd, hd.diagonal() + np.float32(0.01 * np.mean(np.diag(h))))
        idx, steps = gptq.gptq(w, n, lv, 64)
        c = unit[idx]
        hv_ = np.array(hv.h, np.float32)
        res = {}
        t0 = time.process_time(); sf = gptq.refit_steps(w, c, 64, hd); res["t_full"] = time.process_time() - t0
        t0 = time.process_time(); sb = blockdiag_refit(w, c, 64, hd); res["t_bd"] = time.process_time() - t0
        sg = steps * np.sqrt(d)  # GPTQ's steps in unit-code units
        def err(s):
            e = w - c * np.repeat(s.astype(np.float16).astype(np.float32), 64, axis=1)
            return float(np.einsum("ij,ij->", e @ hv_, e)) / float(np.einsum("ij,ij->", w @ hv_, w))
        for k, s in (("full", sf), ("blockdiag", sb), ("gptq", sg)):
            res[k] = err(s); tot.setdefault(k, []).append(res[k])
        print(i, name, {k: (round(v, 6) if "t_" not in k else round(v, 3)) for k, v in res.items()}, flush=True)
print({k: float(np.mean(v)) for k, v in tot.items()})
