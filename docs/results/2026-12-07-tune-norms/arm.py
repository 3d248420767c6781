"""Tuning the norms' weights beside the row scales, each as a factor 1 + step * d (d trained from 0),
against the row scales alone; both from the same untuned artifact (quantize --tune-steps 0 with the
pipeline's moments), `auto` steps for the width. Decides on 20 calibration-text windows the
calibrate stage never drew; the evaluation texts are reported, never used to choose.

    python arm.py ARTIFACT SOURCE OUT.json [--norm-step S] [--steps N]
"""
import argparse, json, time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vqpipe import text
from vqpipe.quant import tune as T
from vqpipe.stages.bench_quality import load_source
from vqpipe.store.quantized import load_quantized

p = argparse.ArgumentParser()
p.add_argument("artifact"); p.add_argument("source"); p.add_argument("out")
p.add_argument("--norm-step", type=float, default=None)
p.add_argument("--steps", type=int, default=None)
a = p.parse_args()
source, tok = load_source(a.source)
teacher = T.teacher_of(source)
model, _ = load_quantized(a.artifact)
meta = json.load(open(a.artifact + "/quantized.json"))
bits = meta["bits"]
steps = a.steps if a.steps is not None else T.steps_for("auto", bits)
tokens = text.calibration_tokens(tok, 64, 512, seed=0)
rec = T.tune(model, teacher, tokens, steps, length=256, norm_step=a.norm_step, progress=print)
ids = np.asarray(text.tokens(tok, "calibration"), dtype=np.int32)
slots = len(ids) // 512
drawn = set(np.random.default_rng(0).choice(slots, 64, replace=False).tolist())
free = [s for s in range(slots) if s not in drawn]
held = [free[(j * len(free)) // 20] for j in range(20)]


def kls(wins):
    out = []
    for w in wins:
        x = w[None]
        out.append(T.kl_to(model, x, *T.target(teacher(x))).item())
    return out


rec["heldout20"] = kls([mx.array(ids[s * 512: (s + 1) * 512]) for s in held])
for corpus in ("devil", "jargon"):
    rec[corpus] = kls(text.eval_windows(tok, 20, 512, corpus=corpus))
rec["arm"] = {"norm_step": a.norm_step, "bits": bits, "steps": steps}
print(a.norm_step, bits, "held-out 20", np.median(rec["heldout20"]), "devil", np.median(rec["devil"]),
      "jargon", np.median(rec["jargon"]), flush=True)
json.dump(rec, open(a.out, "w"), indent=1)
