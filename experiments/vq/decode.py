"""Decode of SmolLM2 with trellis codes against scalar codes at the same bits (issue 34: is the
trellis default as fast as the scalar codes?), beside the unquantized source.

Arms, interleaved per trial in one process (prompts rotated over experiments.ext_decode's 20),
greedy, ``--tokens`` tokens through mlx-lm's ``stream_generate``: ``trellis`` and ``scalar`` (two
reservoirs of experiments/vq/pipeline.py through vqpipe.load: the default decode path),
``scalar-aa`` (the A/A floor) and ``source`` (mlx-lm on the source); with ``--affine``, ``affine4``
(the source through MLX's nn.quantize, 4 bits, group 64: what a user of mlx-lm gets). Ratios per
trial, then their median [min-max]. ``--device gpu`` runs it on the default GPU (CUDA: the trellis
layers' mat-vec is csrc/trellis.cu).

    python -m experiments.vq.decode --trellis DIR --scalar DIR --source DIR --out FILE.json
"""

import argparse
import json
import os
import statistics

import mlx.core as mx

from experiments.ext_decode import PROMPTS, decode, summary


def main(argv=None):
    import mlx_lm

    import vqpipe

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trellis", required=True)
    ap.add_argument("--scalar", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--affine", action="store_true", help="add mlx-lm's affine 4-bit (group 64) of the source")
    args = ap.parse_args(argv)
    mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    trellis_model, tok = vqpipe.load(args.trellis)
    scalar_model, _ = vqpipe.load(args.scalar)
    source, stok = mlx_lm.load(args.source)
    table = {"scalar": (scalar_model, tok), "trellis": (trellis_model, tok), "scalar-aa": (scalar_model, tok),
             "source": (source, stok)}
    pairs = [("trellis", "scalar"), ("scalar-aa", "scalar"), ("trellis", "source")]
    if args.affine:
        import mlx.nn as nn

        affine, atok = mlx_lm.load(args.source)
        nn.quantize(affine, group_size=64, bits=4)
        mx.eval(affine.parameters())
        table["affine4"] = (affine, atok)
        pairs += [("trellis", "affine4"), ("scalar", "affine4")]
    for model, t in table.values():  # warm-up
        decode(model, t, PROMPTS[0], 4)
    rates = {k: [] for k in table}
    load0 = os.getloadavg()
    for i in range(args.trials):
        prompt = PROMPTS[i % len(PROMPTS)]
        for name, (model, t) in table.items():
            rates[name].append(decode(model, t, prompt, args.tokens)[0])
        print(f"trial {i + 1}/{args.trials}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()), flush=True)
    ratios = {}
    for a, b in pairs:
        per = [x / y for x, y in zip(rates[a], rates[b])]
        ratios[f"{a}/{b}"] = summary(per)
        print(f"{a}/{b}: median {statistics.median(per):.3f} [{min(per):.3f}-{max(per):.3f}] n={len(per)}")
    with open(args.out, "w") as f:
        json.dump({"tokens_per_s": {k: summary(v) for k, v in rates.items()}, "ratios": ratios,
                   "load": [load0, os.getloadavg()], "tokens": args.tokens,
                   "device": str(mx.default_device())}, f, indent=1)


if __name__ == "__main__":
    main()
