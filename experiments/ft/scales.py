"""End-to-end tuning of a quantized model's row scales (and optionally its norms) against the
source model's next-token distribution on calibration text, DWQ-style: does it close the 2-bit
gap of issue 34? An experiment outside the package.

    python -m experiments.ft.scales --quantized DIR --source DIR [--windows 32] [--steps 64] [--lr 1e-3]

Every quantized layer's weight is frozen at its dequantized value W = diag(s) C R; a factor g per
output row (init 1) is trained, so the tuned model stores s * g: the same codes, the same bits.
The tied embedding's factor scales both the lookup and the head. Loss: KL(source || model) per
token on calibration windows (the calibrate stage's draw); evaluation: bench-quality's windows of
both texts, KL and perplexity before and after, paired per window.
"""

import argparse
import json
import math
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from vqpipe import text
from vqpipe.stages import bench_quality as bq
from vqpipe.store.quantized import load_quantized


class RowScaled(nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = weight
        self.g = mx.ones((weight.shape[0],), dtype=mx.float32)
        if bias is not None:
            self.bias = bias

    def __call__(self, x):
        y = (x @ self.weight.T) * self.g
        return y + self.bias if "bias" in self else y

    def folded(self):
        lin = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias="bias" in self)
        lin.weight = self.weight * self.g[:, None]
        if "bias" in self:
            lin.bias = self.bias
        return lin


class RowScaledEmbedding(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight
        self.g = mx.ones((weight.shape[0],), dtype=mx.float32)

    def __call__(self, ids):
        return self.weight[ids] * self.g[ids][..., None]

    def as_linear(self, x):
        return (x @ self.weight.T) * self.g

    def folded(self):
        emb = nn.Embedding(*self.weight.shape)
        emb.weight = self.weight * self.g[:, None]
        return emb


def wrap(model):
    swaps = []
    for name, m in model.named_modules():
        if name.endswith("lm_head") or isinstance(m, nn.Linear):
            swaps.append((name, RowScaled(m.weight, m.get("bias"))))
        elif isinstance(m, nn.Embedding):
            swaps.append((name, RowScaledEmbedding(m.weight)))
    model.update_modules(tree_unflatten(swaps))
    return [n for n, _ in swaps]


def unwrap(model):
    swaps = [(n, m.folded()) for n, m in model.named_modules() if isinstance(m, (RowScaled, RowScaledEmbedding))]
    model.update_modules(tree_unflatten(swaps))
    mx.eval(model.parameters())


def evaluate(model, refs, windows):
    out = []
    for ref, w in zip(refs, windows):
        lp = bq.window_logprobs(model, w)
        kl, top1, nll = bq.window_metrics(ref, lp, np.asarray(w))
        out.append({"kl": kl, "top1": top1, "nll": nll})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantized", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--windows", type=int, default=32, help="calibration windows")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--norms", action="store_true", help="train the RMSNorm weights too")
    p.add_argument("--eval-windows", type=int, default=10)
    p.add_argument("--holdout", type=int, default=8, help="calibration windows held out of training: the score a setting is chosen by")
    p.add_argument("--out")
    args = p.parse_args()

    teacher, tok = bq.load_source(args.source)
    student = bq.dense_copy(bq._fp32(load_quantized(args.quantized)[0]))
    names = wrap(student)
    student.freeze()
    student.apply_to_modules(lambda n, m: m.unfreeze(keys=["g"]) if isinstance(m, (RowScaled, RowScaledEmbedding)) else None)
    if args.norms:
        student.apply_to_modules(lambda n, m: m.unfreeze(keys=["weight"]) if isinstance(m, nn.RMSNorm) else None)
    ntrain = sum(v.size for _, v in tree_flatten(student.trainable_parameters()))
    print(f"{len(names)} row-scaled modules, {ntrain} trainable parameters")

    # evaluation references, from the source, before training
    import tempfile
    tmp = tempfile.mkdtemp()
    evals = {}
    for corpus in bq.TEXTS:
        ws = text.eval_windows(tok, args.eval_windows, 512, corpus=corpus)
        refs = [bq.reference(bq.window_logprobs(teacher, w), f"{tmp}/{corpus}{i}.npy") for i, w in enumerate(ws)]
        evals[corpus] = (refs, ws)
    per = 512 // args.length  # training windows per 512-token draw row (the held-out rows stay 512)
    n_rows = -(-args.windows // per)
    draw = text.calibration_tokens(tok, n_rows + args.holdout, 512, seed=0)
    perm = np.random.default_rng(1).permutation(len(draw))
    calib = draw[mx.array(perm[:n_rows])].reshape(-1, args.length)[: args.windows]
    held = [draw[int(i)] for i in perm[args.windows:]]
    evals["holdout"] = ([bq.reference(bq.window_logprobs(teacher, w), f"{tmp}/held{i}.npy") for i, w in enumerate(held)], held)
    unwrap_copy = None

    def eval_all(model):
        return {c: evaluate(model, refs, ws) for c, (refs, ws) in evals.items()}

    # before: fold (g = 1) into a plain copy
    unwrap(student)
    before = eval_all(student)
    wrap(student)
    student.freeze()
    student.apply_to_modules(lambda n, m: m.unfreeze(keys=["g"]) if isinstance(m, (RowScaled, RowScaledEmbedding)) else None)
    if args.norms:
        student.apply_to_modules(lambda n, m: m.unfreeze(keys=["weight"]) if isinstance(m, nn.RMSNorm) else None)

    def loss_fn(model, x, p_logp, p):
        lp = nn.log_softmax(model(x).astype(mx.float32), axis=-1)
        return mx.mean(mx.sum(p * (p_logp - lp), axis=-1))

    vg = nn.value_and_grad(student, loss_fn)
    opt = optim.Adam(learning_rate=args.lr)
    losses = []
    t0 = time.time()
    for step in range(args.steps):
        idx = [(step * args.batch + j) % args.windows for j in range(args.batch)]
        x = calib[mx.array(idx)]
        t_lp = nn.log_softmax(teacher(x).astype(mx.float32), axis=-1)
        t_p = mx.exp(t_lp)
        mx.eval(t_lp, t_p)
        loss, grads = vg(student, x, t_lp, t_p)
        opt.update(student, grads)
        mx.eval(student.parameters(), opt.state, loss)
        losses.append(float(loss))
        if step % 8 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
    gs = np.concatenate([np.asarray(m.g) for _, m in student.named_modules() if isinstance(m, (RowScaled, RowScaledEmbedding))])
    print(f"g: mean {gs.mean():.4f} std {gs.std():.4f} min {gs.min():.3f} max {gs.max():.3f}")
    unwrap(student)
    after = eval_all(student)
    result = {"args": vars(args), "losses": losses, "train_s": time.time() - t0}
    for c in (*bq.TEXTS, "holdout"):
        kb = [r["kl"] for r in before[c]]
        ka = [r["kl"] for r in after[c]]
        ratio = [a / b for a, b in zip(ka, kb)]
        pb = math.exp(statistics.mean(r["nll"] for r in before[c]))
        pa = math.exp(statistics.mean(r["nll"] for r in after[c]))
        print(f"{c}: KL {statistics.median(kb):.4f} -> {statistics.median(ka):.4f}, ratio median "
              f"{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}], lower in "
              f"{sum(r < 1 for r in ratio)}/{len(ratio)}; ppl {pb:.2f} -> {pa:.2f}")
        result[c] = {"before": before[c], "after": after[c]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
