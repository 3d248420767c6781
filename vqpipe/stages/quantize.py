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
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx

from .. import __version__
from ..codec.codebook import BITS
from ..store import manifest, record
from .. import parallel
from ..quant import recipe, residual_rotation
from ..store.fsutil import atomic_dir, save_safetensors
from ..layers.fused import fuse_model
from ..prefault import Prefault
from ..quant.quantize import (
    assemble,
    build_layers,
    quantize_model,
    quantized_layers,
    residual_identity,
    skeleton,
    split_state,
)
from ..codec.rotation import KINDS

REFERENCE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while the river runs north.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1969 the first people walked on the Moon; the mission lasted eight days.",
    "Quantized weights keep their row norms; the rotation spreads outliers evenly.",
)
DTYPES = {"source": None, "float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_CONFIG_DROP = ("quantization", "quantization_config")
PREFAULT_SLACK = 96 << 20  # the reference logits' other buffers taken from the same heap top


def copy_model_files(src, dst, extra_config=None):
    """Copy config and tokenizer files (not weights); drop affine quantization keys from config."""
    src, dst = Path(src), Path(dst)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
            "model.safetensors.index.json", "config.json", "vqpipe-source.json"
        ):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    for key in _CONFIG_DROP:
        config.pop(key, None)
    if extra_config:
        config.update(extra_config)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def reference_tokens(tokenizer):
    return [mx.array(tokenizer.encode(p), dtype=mx.int32) for p in REFERENCE_PROMPTS]


class _Tap:
    """Stands in for a transformer block while the forwards are built: keeps its outputs."""

    def __init__(self, block, outs):
        self.block, self.outs = block, outs

    def __getattr__(self, name):  # a model may read its blocks' attributes (sliding windows, ...)
        return getattr(self.block, name)

    def __call__(self, *args, **kwargs):
        y = self.block(*args, **kwargs)
        self.outs.append(y)
        return y


def reference_logits(model, tokenizer):
    """{"tokens.i", "logits.i"}: float32 logits of each reference prompt, one forward each.

    The forwards are built first (MLX is lazy) with each layer's weight decoded once for all of
    them (dequant.decoded_once), then computed a transformer block at a time, every prompt's
    block l before any block l + 1, so a block's decoded weights are freed once its last prompt
    has used them: one block's (and the head's) are alive at a time, not the whole model's.
    Each prompt runs the same operations on the same values as a forward of its own: the same
    bytes. (qwen2.5-0.5b, on its own: the whole model's 2 GB of decoded float32 weights were held
    and faulted in; peak RSS 3.18 -> 1.19 GB, 13.8 -> 4.4 s; docs/results/2026-12-05-logs/quantize.md, "Fifth pass".)"""
    from ..kernels.dequant import decoded_once

    tokens = reference_tokens(tokenizer)
    inner = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    outs = []
    tapped = isinstance(blocks, list) and len(blocks) > 0
    if tapped:
        inner.layers = [_Tap(b, outs) for b in blocks]
    try:
        with decoded_once():
            logits = [model(t[None]).astype(mx.float32) for t in tokens]
    finally:
        if tapped:
            inner.layers = blocks
    # The largest decoded weight (a tied head's: qwen2.5-0.5b 545 MB of float32) is fresh memory,
    # whose page faults cost 1-3 s a GB on our VM: a helper thread populates it from the heap while
    # the blocks are computed (vqpipe/prefault.py; a no-op below 64 MB and on a GPU).
    biggest = max((m.out_features * m.in_features * 4 for m in quantized_layers(model).values()), default=0)
    with Prefault(biggest + PREFAULT_SLACK):
        if tapped and len(outs) == len(blocks) * len(tokens):
            for l in range(len(blocks)):  # outs: prompt 0's blocks in order, then prompt 1's, ...
                mx.eval(outs[l::len(blocks)])
        del outs[:]
        mx.eval(logits)
    out = {}
    for i, (t, y) in enumerate(zip(tokens, logits)):
        out[f"tokens.{i}"] = t
        out[f"logits.{i}"] = y[0]
    return out


def environment():
    from ..bench.env import environment as env

    return env()


def save_quantized(model, tokenizer, source_dir, out_dir, info):
    metas, arrays, params = split_state(model)
    tensors = {f"layers.{k}": v for k, v in arrays.items()}
    tensors.update({f"params.{k}": v for k, v in params.items()})
    with atomic_dir(out_dir, manifest=True) as tmp:
        save_safetensors(tmp / "quantized.safetensors", tensors)
        copy_model_files(source_dir, tmp, {"vqpipe": {k: info[k] for k in ("bits", "rotation", "seed")}})
        ref = reference_logits(model, tokenizer)  # each layer decoded once for the 4 prompts
        save_safetensors(tmp / "reference.safetensors", ref)
        env = environment()  # the reference logits' setup: validate compares against it
        (tmp / "reference.json").write_text(json.dumps(
            {"prompts": list(REFERENCE_PROMPTS), "environment": env}, indent=2) + "\n")
        record.write(tmp / "quantized.json", "quantize", {**info, "layers": metas},
                     model=record.model_name(source_dir), variant=f"b{info['bits']}-{info['rotation']}",
                     environment=env, inputs={"source": source_dir})


def load_quantized(path):
    """(model, tokenizer) from a quantize-stage artifact."""
    from mlx_lm.utils import load_tokenizer

    path = Path(path)
    meta = json.loads((path / "quantized.json").read_text())
    tensors = mx.load(str(path / "quantized.safetensors"))
    arrays = {k[len("layers."):]: v for k, v in tensors.items() if k.startswith("layers.")}
    params = {k[len("params."):]: v for k, v in tensors.items() if k.startswith("params.")}
    model = assemble(skeleton(path), build_layers(meta["layers"], arrays), params, str(path))
    residual_rotation.mark(model, meta.get("residual_rotation"))
    mx.eval(model.parameters())
    fuse_model(model)
    return model, load_tokenizer(path)


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CALIBRATION_TEXTS = ("none", "text", "self")


def auto_calibration(source):
    """The recipe's calibration text for a download-stage ``source``: ``text``, or ``none`` for a
    synthetic model (random weights: no text says what they compute; as the config's ``auto``)."""
    path = Path(source) / "vqpipe-source.json"
    spec = json.loads(path.read_text()).get("source", "") if path.is_file() else ""
    return "none" if spec.startswith("synth:") else "text"


def calibration_tokens(tokenizer, text="none", windows=64, length=512, seed=0, model=None):
    """(tokens [windows, length] or None, provenance dict or None) for a calibration spec.

    ``text``: ``none`` (data-free quantization), ``text`` (the calibration split of the real
    English text in vqpipe/text.py, disjoint from the evaluation split) or ``self`` (text the
    source ``model`` writes itself from a few seed requests, vqpipe/quant/selfgen.py).
    """
    if text not in CALIBRATION_TEXTS:
        raise ValueError(f"unknown calibration text {text!r}; choose one of {', '.join(CALIBRATION_TEXTS)}")
    if text == "none":
        return None, None
    if windows < 1 or length < 2:
        raise ValueError(f"calibration needs at least 1 window of 2 tokens, got {windows} x {length}")
    spec = {"text": text, "windows": windows, "length": length, "seed": seed}
    if text == "self":
        from ..quant import selfgen

        if model is None:
            raise ValueError("self-generated calibration needs the source model")
        return selfgen.self_tokens(model, tokenizer, windows, length, seed), {**spec, "provenance": selfgen.provenance(tokenizer)}
    from .. import text as corpus

    tokens = corpus.calibration_tokens(tokenizer, windows, length, seed)
    return tokens, {**spec, "provenance": corpus.provenance()}


def run(source, out, bits, rotation="auto", seed=0, embeddings=True, lm_head=True, dtype="source",
        progress=print, group_size=None, calibration=None, calib_windows=64, calib_length=512,
        calib_seed=0, damp=None, moments=None, sequential=False, layer_bits=None, threads=1, residual=False,
        budget="auto"):
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if calibration in (None, "auto"):
        calibration = "none" if moments is not None else auto_calibration(source)
    if group_size is not None and group_size < 1:
        raise ValueError(f"group size must be a positive integer, got {group_size}")
    if damp is not None and not 0 < damp < 1:
        raise ValueError(f"damping must be in (0, 1), got {damp}")
    source = Path(source)
    if not (source / "config.json").is_file():
        raise ValueError(f"source model directory {source} has no config.json")
    # A download-stage artifact: its checksums are computed beside the load and the first blocks
    # (a helper thread) and checked before anything is written; a damaged source is reported as
    # such even where the damage made the quantization itself fail first.
    check = manifest.Background(source)
    try:
        info = _quantize(source, bits, rotation, seed, embeddings, lm_head, dtype, progress, group_size,
                         calibration, calib_windows, calib_length, calib_seed, damp, moments, sequential,
                         layer_bits, threads, residual, budget)
    except BaseException:
        check.result()
        raise
    check.result()
    save_quantized(info.pop("model"), info.pop("tokenizer"), source, out, info)
    progress(f"quantized {len(info['records'])} layers in {info['quantize_seconds']:.1f}s, "
             f"peak RSS {info['peak_rss_bytes'] / 2**20:.0f} MiB -> {out}")
    return info


def _quantize(source, bits, rotation, seed, embeddings, lm_head, dtype, progress, group_size,
              calibration, calib_windows, calib_length, calib_seed, damp, moments, sequential, layer_bits,
              threads, residual=False, budget="auto"):
    """The quantized model, its tokenizer and the record's fields (run's work before saving)."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(source), lazy=True)
    tokens, calib = calibration_tokens(tokenizer, calibration, calib_windows, calib_length, calib_seed, model)
    stored = fisher = None
    if moments is not None:
        if tokens is not None:
            raise ValueError("--moments and --calibration text both give calibration; choose one")
        from . import calibrate as mom

        ident = residual_identity(model, rotation, seed) if residual else None
        stored, minfo = mom.load(moments, ident)
        fisher = mom.load_fisher(moments, ident)
        calib = {**minfo["calibration"], "moments": str(moments), "sensitivity": minfo.get("sensitivity")}
    elif calib is not None:
        calib["sequential"] = sequential
    t0 = time.perf_counter()
    records = quantize_model(model, bits, rotation, seed, embeddings, lm_head, DTYPES[dtype], progress,
                             group_size, tokens, damp, moments=stored, sequential=sequential,
                             layer_bits=layer_bits, threads=threads, residual=residual, fisher=fisher,
                             budget=budget)
    seconds = time.perf_counter() - t0
    total, weights = recipe.model_bits(model)
    allocation = {"budget": recipe.check_budget(budget, bits), "bpw": total / weights,
                  "rules": bool(layer_bits),
                  # the widths came from vqpipe/quant/recipe.py (quantize_model's condition)
                  "automatic": calib is not None and not layer_bits and budget != "none" and not sequential
                  and (moments is None or fisher is not None),
                  "widths": {r["name"]: r["bits"] for r in records if r["bits"] != bits}}
    info = {
        "vqpipe_version": __version__, "source": str(source), "bits": bits, "rotation": rotation,
        "seed": seed, "embeddings": embeddings, "lm_head": lm_head, "dtype": dtype,
        "group_size": group_size, "calibration": calib, "damp": damp, "layer_bits": layer_bits or [],
        "allocation": allocation,
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
    p.add_argument("--calibration", default="auto", choices=("auto",) + CALIBRATION_TEXTS,
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
            threads=parallel.default_threads() if args.threads is None else args.threads)
    except (ValueError, OSError) as e:  # OSError: e.g. disk full, named with its path
        where = "" if isinstance(e, ValueError) or e.filename else f"writing {args.out}: "
        print(f"vqpipe quantize: error: {where}{e}", file=sys.stderr)
        return 2
    return 0
