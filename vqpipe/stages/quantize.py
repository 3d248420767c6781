"""The quantize stage: replace every nn.Linear of an mlx-lm model by a QuantizedLinear.

Artifact (a directory, written atomically):
    quantized.safetensors   packed layers ("layers.<name>.<key>") and every other tensor ("params.<name>")
    quantized.json          per-layer state meta, options, per-layer errors, time and peak RSS
    config.json + tokenizer files   copied from the source (config without affine quantization keys)
    reference.safetensors   logits of the quantized model on fixed prompts (what validate compares)
    reference.json          the prompts and the environment that made the logits (backend, BLAS)

The pack stage reads this artifact; no pack option can make quantization run again.
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from .. import __version__
from ..parallel import default_threads
from ..codec.codebook import BITS
from ..codec.rotation import KINDS
from ..quant import recipe, residual_rotation, tune
from ..quant.calibrate import auto_calibration, calibration_tokens
from ..layers.qlinear import CODES
from ..quant.config import CALIB_TEXTS, QuantizeConfig
from ..quant.config import DTYPES as FLOAT_DTYPES
from ..quant.quantize import quantize_model, residual_identity
from ..store import manifest
from ..store.calibration import load as load_moments
from ..store.calibration import load_fisher
from ..store.quantized import save_quantized

DTYPES = ("source",) + FLOAT_DTYPES  # source: each tensor as the source stores it


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(source, out, bits=4, rotation="auto", seed=0, embeddings=True, lm_head=True, dtype="source",
        progress=print, group_size=None, calibration=None, calib_windows=64, calib_length=512,
        calib_seed=0, damp=None, moments=None, sequential=False, layer_bits=None, threads=None, residual=False,
        budget="auto", codes=QuantizeConfig.codes, tune_steps=QuantizeConfig.tune_steps, tune_lr=QuantizeConfig.tune_lr,
        tune_length=QuantizeConfig.tune_length):
    """Quantize ``source`` into the artifact ``out``; the arguments are the CLI's (threads None:
    every core this process may run on). Returns the record quantized.json holds."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if calibration in (None, "auto"):
        calibration = "none" if moments is not None else auto_calibration(source)
    elif moments is not None and calibration != "none":
        raise ValueError("--moments and --calibration text both give calibration; choose one")
    config = QuantizeConfig(
        bits=bits, rotation=rotation, seed=seed, embeddings=embeddings, lm_head=lm_head,
        dtype=None if dtype == "source" else dtype, group_size=group_size, damp=damp, sequential=sequential,
        layer_bits=layer_bits, residual=residual, budget=budget,
        threads=default_threads() if threads is None else threads, calib_text=calibration,
        calib_windows=calib_windows, calib_length=calib_length, calib_seed=calib_seed, codes=codes,
        tune_steps=tune_steps, tune_lr=tune_lr, tune_length=tune_length)
    source = Path(source)
    if not (source / "config.json").is_file():
        raise ValueError(f"source model directory {source} has no config.json")
    # A download-stage artifact: its checksums are computed beside the load and the first blocks
    # (a helper thread) and checked before anything is written; a damaged source is reported as
    # such even where the damage made the quantization itself fail first.
    check = manifest.Background(source)
    try:
        info = _quantize(source, config, moments, progress)
    except BaseException:
        check.result()
        raise
    check.result()
    save_quantized(info.pop("model"), info.pop("tokenizer"), source, out, info)
    progress(f"quantized {len(info['records'])} layers in {info['quantize_seconds']:.1f}s, "
             f"peak RSS {info['peak_rss_bytes'] / 2**20:.0f} MiB -> {out}")
    return info


def _quantize(source, config, moments=None, progress=print):
    """The quantized model, its tokenizer and the record's fields (run's work before saving)."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(source), lazy=True)
    tokens, calib = calibration_tokens(tokenizer, config.calib_text, config.calib_windows, config.calib_length,
                                       config.calib_seed, model)
    stored = fisher = None
    tune_tokens = tokens
    if moments is not None:
        ident = residual_identity(model, config.rotation, config.seed) if config.residual else None
        stored, minfo = load_moments(moments, ident)
        fisher = load_fisher(moments, ident)
        calib = {**minfo["calibration"], "moments": str(moments), "sensitivity": minfo.get("sensitivity")}
        if config.tune_steps:  # tuned on the windows the moments were collected from
            c = minfo["calibration"]
            tune_tokens, _ = calibration_tokens(tokenizer, c["text"], c["windows"], c["length"], c["seed"], model)
    elif calib is not None:
        calib["sequential"] = config.sequential
    t0 = time.perf_counter()
    summary = {}
    records = quantize_model(model, config, calibration=tokens, moments=stored, fisher=fisher, tune_tokens=tune_tokens,
                             summary=summary, progress=progress)
    seconds = time.perf_counter() - t0
    total, weights = recipe.model_bits(model)
    bits, layer_bits = config.bits, config.layer_bits
    allocation = {"budget": recipe.check_budget(config.budget, bits), "bpw": total / weights,
                  "rules": bool(layer_bits),
                  # the widths came from vqpipe/quant/recipe.py (quantize_model's condition)
                  "automatic": calib is not None and not layer_bits and config.budget != "none"
                  and not config.sequential and (moments is None or fisher is not None),
                  "widths": {r["name"]: r["bits"] for r in records if r["bits"] != bits}}
    info = {
        "vqpipe_version": __version__, "source": str(source), "bits": bits, "rotation": config.rotation,
        "seed": config.seed, "embeddings": config.embeddings, "lm_head": config.lm_head,
        "dtype": config.dtype or "source", "group_size": config.group_size, "calibration": calib,
        "damp": config.damp, "layer_bits": layer_bits or [], "allocation": allocation, "codes": config.codes,
        "tune": summary.get("tune"),
        "residual_rotation": residual_rotation.of(model),
        "quantize_seconds": seconds, "peak_rss_bytes": peak_rss_bytes(), "records": records,
        "model": model, "tokenizer": tokenizer,
    }
    return info


def _budget(text):
    if text in ("auto", "none"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not auto, none or a number: {text!r}") from None


def _steps(text):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not auto or an integer: {text!r}") from None


def parser():
    p = argparse.ArgumentParser(prog="vqpipe quantize", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="source model directory (download stage output)")
    p.add_argument("--out", required=True, help="output artifact directory")
    p.add_argument("--bits", type=int, default=4, help=f"bits per weight, one of {BITS}")
    p.add_argument("--rotation", default="auto", help=f"one of {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="quantize the embedding table (and so a tied output head), as mlx_lm.convert does "
                   "(default); --no-embeddings keeps it in --dtype")
    p.add_argument("--no-lm-head", dest="lm_head", action="store_false", help="keep an untied lm_head dense")
    p.add_argument("--dtype", default="source",
                   help=f"dtype of tensors that stay unquantized: one of {', '.join(DTYPES)} (default: source, "
                   "each tensor as the source stores it)")
    p.add_argument("--group-size", type=int, default=None,
                   help="a float16 scale per this many rotated entries of a row (default: one per row)")
    p.add_argument("--calibration", default="auto", choices=CALIB_TEXTS,
                   help="auto (default): text, or none with --moments or for a synth: source; text: GPTQ and the bit allocation from the calibration split of vqpipe/text.py; "
                   "self: from text the model writes itself (vqpipe/quant/selfgen.py); none: data-free")
    p.add_argument("--calib-windows", type=int, default=64, help="calibration windows")
    p.add_argument("--calib-length", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration window offsets")
    p.add_argument("--damp", type=float, default=None, help="GPTQ damping, fraction of mean(diag H) (0.01)")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=False,
                   help="with --calibration: each block's moments from the already quantized blocks (no bit "
                   "allocation then); default --no-sequential: from the full-precision model, as the calibrate stage")
    p.add_argument("--budget", default="auto", type=_budget, metavar="BPW",
                   help="bits per weight over every quantized matrix for the automatic per-layer widths "
                   "(vqpipe/quant/recipe.py): auto (default: bits + 0.5, what MLX affine g64 stores), none (every layer "
                   "at --bits), or a number; --layer-bits rules replace the allocation")
    p.add_argument("--layer-bits", default=None, metavar="JSON",
                   help='mixed widths (vqpipe/codec/allocate.py): a JSON list of rules {"match": REGEX, "add": N} '
                   '(N bits over --bits) or {"match": REGEX, "bits": N} for the layers whose names match')
    p.add_argument("--moments", default=None, metavar="DIR",
                   help="GPTQ with the full-precision moments of a calibrate-stage artifact (no forward pass)")
    p.add_argument("--residual-rotation", action=argparse.BooleanOptionalAction, default=False,
                   help="fold one rotation of the residual stream into the model first (vqpipe/quant/residual_rotation.py): "
                   "q/k/v, gate/up and the head then need no rotation per token; needs --rotation auto, hadamard or kron")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for the numpy work of GPTQ and group scales (vqpipe/parallel.py; the result "
                   "does not depend on it); default: the cores this process may run on")
    p.add_argument("--codes", default=QuantizeConfig.codes, choices=CODES,
                   help="trellis (default): bitshift-trellis codes (block LDLQ, vqpipe/codec/ldlq.py) for every "
                   "layer at 2-5 bits with per-row scales whose shape tiles (32 rows x 8 inputs), the others "
                   "scalar; scalar: the Lloyd-Max codebook for every layer")
    p.add_argument("--tune-steps", type=_steps, default=QuantizeConfig.tune_steps, metavar="N",
                   help=f"steps of end-to-end tuning of the row scales against the source on the "
                   f"calibration windows, one window a step (vqpipe/quant/tune.py; default {QuantizeConfig.tune_steps}: "
                   f"{tune.LOW_STEPS} at 2 bits, {tune.STEPS} at 3, none above; 0: none; data-free quantization has no windows "
                   "and is not tuned)")
    p.add_argument("--tune-lr", type=float, default=QuantizeConfig.tune_lr,
                   help="the tuning's Adam learning rate at its first step (a cosine decay to a tenth by the last)")
    p.add_argument("--tune-length", type=int, default=QuantizeConfig.tune_length, metavar="TOKENS",
                   help=f"tokens a tuning step reads: the calibration windows cut into pieces of this length "
                   f"(default {QuantizeConfig.tune_length})")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        layer_bits = None if args.layer_bits is None else json.loads(args.layer_bits)
    except ValueError as e:
        print(f"vqpipe quantize: error: --layer-bits is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        run(args.source, args.out, args.bits, args.rotation, args.seed, args.embeddings, args.lm_head, args.dtype,
            group_size=args.group_size, calibration=args.calibration, calib_windows=args.calib_windows,
            calib_length=args.calib_length, calib_seed=args.calib_seed, damp=args.damp, moments=args.moments,
            sequential=args.sequential, layer_bits=layer_bits, residual=args.residual_rotation, budget=args.budget,
            threads=args.threads, codes=args.codes, tune_steps=args.tune_steps, tune_lr=args.tune_lr,
            tune_length=args.tune_length)
    except (ValueError, OSError) as e:  # OSError: e.g. disk full, named with its path
        where = "" if isinstance(e, ValueError) or e.filename else f"writing {args.out}: "
        print(f"vqpipe quantize: error: {where}{e}", file=sys.stderr)
        return 2
    return 0
