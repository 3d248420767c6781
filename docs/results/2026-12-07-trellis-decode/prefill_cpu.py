"""Prefill on the CPU of a reservoir: the trellis weights decoded by ext.trellis_decode (the default)
against MLX ops (ext.using(False): the extension off; at M > ext.MAX_M rows nothing else of it runs).
Arms interleaved per prompt, distinct prompts of --length tokens from the evaluation text, one warm-up
each; wall time of model(x) evaluated, MLX peak memory of the call.

    python prefill_cpu.py RESERVOIR [--prompts 20] [--length 512]
"""
import argparse, json, statistics, time

import mlx.core as mx

import vqpipe
from vqpipe import text
from vqpipe.kernels import ext

p = argparse.ArgumentParser()
p.add_argument("model"); p.add_argument("--prompts", type=int, default=20); p.add_argument("--length", type=int, default=512)
p.add_argument("--out")
a = p.parse_args()
model, tok = vqpipe.load(a.model)
wins = text.eval_windows(tok, a.prompts + 1, a.length)


def run(x, on):
    mx.reset_peak_memory()
    t = time.perf_counter()
    with ext.using(on):
        y = model(x[None])
        mx.eval(y)
    return time.perf_counter() - t, mx.get_peak_memory() / 2**20, y


for on in (True, False):
    run(wins[0], on)
rec = {"ext": [], "mlx": [], "ext_peak": [], "mlx_peak": [], "same": 0}
for w in wins[1:]:
    te, pe, ye = run(w, True)
    tm, pm, ym = run(w, False)
    rec["ext"].append(te); rec["mlx"].append(tm); rec["ext_peak"].append(pe); rec["mlx_peak"].append(pm)
    rec["same"] += int(mx.array_equal(ye, ym).item())
r = sorted(m / e for e, m in zip(rec["ext"], rec["mlx"]))
for k in ("ext", "mlx", "ext_peak", "mlx_peak"):
    v = rec[k]
    print(k, round(statistics.median(v), 4), "[", round(min(v), 4), "-", round(max(v), 4), "]")
print("speed-up mlx/ext per prompt", round(statistics.median(r), 3), "[", round(r[0], 3), "-", round(r[-1], 3), "] n =", len(r),
      "; same logits", rec["same"], "/", len(r))
if a.out:
    json.dump(rec, open(a.out, "w"), indent=1)
