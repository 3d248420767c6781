"""SmolLM2 through the package's quantizer with codes=trellis against codes=scalar (issue 34).

    python -m experiments.vq.pipeline --codes trellis --bits 2 --ref /tmp/vq/ref --out DIR

The quantize stage's own path (vqpipe/stages/quantize.py ``_quantize``: the recipe's widths within
the bits + 0.5 budget, the calibrate artifact's moments), saved as a quantize artifact and packed as
a reservoir (persist_rotation off), then evaluated as experiments/vq/smollm2.py evaluates (bench-
quality's windows and functions, 20 x 512 tokens of each text against the source's reference).
"""

import argparse
import json
import os
import time
from pathlib import Path

from vqpipe.quant.config import QuantizeConfig
from vqpipe.stages import pack
from vqpipe.stages.quantize import _quantize
from vqpipe.store.quantized import save_quantized

from experiments.vq.smollm2 import MOMENTS, SOURCE, evaluate


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--codes", required=True, choices=("scalar", "trellis"))
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--out", required=True, help="directory: quantized/, reservoir/, result.json")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = QuantizeConfig(bits=args.bits, calib_text="none", threads=args.threads, codes=args.codes)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    info = _quantize(SOURCE, config, MOMENTS)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    model = info.pop("model")
    save_quantized(model, info.pop("tokenizer"), SOURCE, out / "quantized", info)
    pack.run(out / "quantized", out / "reservoir", False)
    res = evaluate(model, args.ref, args.windows, 512)
    codes = {}
    for r in info["records"]:
        codes[r["codes"]] = codes.get(r["codes"], 0) + 1
    doc = {"codes": args.codes, "bits": args.bits, "bpw": info["allocation"]["bpw"],
           "quantize_seconds": info["quantize_seconds"], "wall_seconds": wall, "loadavg_start": load0,
           "loadavg_end_quantize": load1, "loadavg_end": os.getloadavg(), "layer_codes": codes,
           "widths": info["allocation"]["widths"], "texts": res}
    (out / "result.json").write_text(json.dumps(doc, indent=1))
    for c, v in res.items():
        print(f"{args.codes} b{args.bits} {c}: KL {v['kl']['median']:.4f} ppl {v['ppl']['median']:.2f} "
              f"(source {v['source_ppl']['median']:.2f}) bpw {doc['bpw']:.4f} quantize {doc['quantize_seconds']:.0f}s",
              flush=True)


if __name__ == "__main__":
    main()
