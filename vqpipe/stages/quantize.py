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
import hashlib
import json
import resource
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import __version__
from ..codebook import BITS, check_bits
from .. import manifest, record
from ..fsutil import atomic_dir, save_safetensors
from ..fused import fuse_model, rotation_owner
from ..qlinear import QuantizedEmbedding, QuantizedLinear
from ..rotation import KINDS, resolve_kind

REFERENCE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while the river runs north.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1969 the first people walked on the Moon; the mission lasted eight days.",
    "Quantized weights keep their row norms; the rotation spreads outliers evenly.",
)
DTYPES = {"source": None, "float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_CONFIG_DROP = ("quantization", "quantization_config")


def layer_seed(seed, name):
    """A per-layer seed: stable across processes and Python versions (no hash())."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _source_dtype(module):
    """The dtype a Linear/Embedding's weight has in the source (an affine layer's: its scales')."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return module.scales.dtype
    return module.weight.dtype


def _sum_squares(weight, rows=8192):
    """sum(w^2) in float32, a chunk of rows at a time (no full-size temporaries)."""
    total = 0.0
    for start in range(0, weight.shape[0], rows):
        w = weight[start:start + rows].astype(mx.float32)
        total += mx.sum(w * w).item()
    return total


def _dense_weight(module, dtype):
    """The full-precision weight of a Linear/Embedding, dequantizing affine-quantized layers."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(
            module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
            mode=getattr(module, "mode", "affine"),
        )
        return w.astype(dtype)
    return module.weight.astype(dtype)


def _targets(model, embeddings, lm_head):
    linear = (nn.Linear, nn.QuantizedLinear)
    embedding = (nn.Embedding, nn.QuantizedEmbedding)
    out = []
    for name, module in model.named_modules():
        if isinstance(module, linear) and (lm_head or name.split(".")[-1] != "lm_head"):
            out.append((name, module, "linear"))
        elif isinstance(module, embedding):
            out.append((name, module, "embedding" if embeddings else "dense-embedding"))
    return out


def quantize_model(model, bits, rotation="auto", seed=0, embeddings=False, lm_head=True,
                   dtype=mx.float32, progress=None, group_size=None, calibration=None, damp=None,
                   fuse=True, sequential=True, moments=None):
    """Quantize ``model`` in place, one layer at a time; returns per-layer records.

    Every nn.Linear (and affine nn.QuantizedLinear, dequantized first) becomes a QuantizedLinear.
    Embeddings are quantized when ``embeddings`` is true, otherwise kept (dequantized if needed)
    in ``dtype``, like every other tensor that is not quantized. ``group_size`` gives each group of
    that many rotated entries of a row its own scale. ``calibration`` (int tokens [n, length])
    turns on GPTQ with input second moments collected block by block (vqpipe/calibrate.py).
    ``moments`` ({name: (key, H)}, vqpipe/stages/calibrate.py) gives GPTQ stored full-precision moments
    instead (no forward pass). ``dtype=None`` keeps each tensor that is not quantized in its source dtype. Linears that read
    the same activation (q/k/v, gate/up) share one rotation (the seed of the first:
    vqpipe/fused.py), and with ``fuse`` they are computed as one (rows concatenated), as the
    loaders do, so the reference logits come from the same code path.
    """
    check_bits(bits)
    if rotation not in KINDS:
        raise ValueError(f"unknown rotation {rotation!r}; choose one of {', '.join(KINDS)}")
    targets = _targets(model, embeddings, lm_head)
    if not any(kind == "linear" for _, _, kind in targets):
        raise ValueError(f"model {type(model).__name__} has no nn.Linear layers to quantize")
    # Keep names only: holding the source modules would keep every evaluated source weight alive.
    targets = [(name, kind) for name, _, kind in targets]
    modules = dict(model.named_modules())
    done = [0]

    def quantize_one(name, kind, hessian):
        t0 = time.perf_counter()
        module = modules.pop(name)
        keep = dtype or _source_dtype(module)
        # In the source dtype: quantize_weight casts row chunks to float32, so a 150k-row embedding
        # never has a whole float32 copy (nor a squared one) alive at once.
        weight = _dense_weight(module, keep)
        record = None
        if kind == "dense-embedding":
            new = nn.Embedding(*weight.shape)
            new.weight = weight.astype(keep)
            mx.eval(new.weight)
        else:
            in_dim = weight.shape[1]
            r = resolve_kind(rotation, in_dim)
            cls = QuantizedEmbedding if kind == "embedding" else QuantizedLinear
            # an embedding gets group scales only as a calibrated tied head (vqpipe/calibrate.py)
            gs = group_size if kind == "linear" or hessian is not None else None
            # one seed for the linears reading one activation: they can share its rotation
            new = cls.from_linear(module, bits, r, layer_seed(seed, rotation_owner(name)), weight=weight,
                                  group_size=gs, hessian=hessian, damp=damp)
            if kind == "embedding":
                new.out_dtype = keep
            if "bias" in module:
                new.bias = module.bias.astype(dtype or module.bias.dtype)
            mx.eval(new.parameters())
            total = _sum_squares(weight)
            record = {
                "name": name, "kind": kind, "shape": list(weight.shape), "rotation": new.rotation.kind,
                "group_size": gs, "calibrated": hessian is not None,
                "squared_error": new.squared_error, "weight_sq": total,
                "rel_mse": new.squared_error / max(total, 1e-30), "seconds": time.perf_counter() - t0,
            }
        model.update_modules(tree_unflatten([(name, new)]))
        done[0] += 1
        if progress and calibration is None:
            progress(f"[{done[0]}/{len(targets)}] {name} {kind} {time.perf_counter() - t0:.2f}s")
        return record

    if moments is not None:  # {name: (key, H)} from a calibrate artifact (vqpipe/stages/calibrate.py)
        records = []
        for name, kind in targets:
            key, hess = moments.get(name, (None, None)) if kind != "dense-embedding" else (None, None)
            records.append(quantize_one(name, kind, hess))
            if hess is not None:
                records[-1]["hessian"] = key
    elif calibration is None:
        records = [quantize_one(name, kind, None) for name, kind in targets]
    else:
        from ..calibrate import quantize_calibrated

        records = quantize_calibrated(model, calibration, quantize_one, targets, progress, sequential)
    records = [r for r in records if r is not None]
    # Remaining tensors (norms, biases of other layers) in the compute dtype.
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    rest = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
            if not any(k.startswith(q + ".") for q in quantized) and mx.issubdtype(v.dtype, mx.floating)
            and dtype is not None and v.dtype != dtype]
    if rest:
        model.load_weights(rest, strict=False)
    mx.eval(model.parameters())
    if fuse:
        fuse_model(model)
    return records


def quantized_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def split_state(model):
    """(layer metas, layer arrays, other params) for a quantized model."""
    layers = quantized_layers(model)
    metas, arrays = {}, {}
    for name, layer in layers.items():
        meta, arr = layer.to_state()
        meta["class"] = type(layer).__name__
        metas[name] = meta
        arrays.update({f"{name}.{k}": v for k, v in arr.items()})
    params = {k: v for k, v in tree_flatten(model.parameters())
              if not any(k.startswith(n + ".") for n in layers)}
    return metas, arrays, params


def build_layers(metas, arrays):
    """{name: QuantizedLinear} from stored metas and ``"<name>.<key>"`` arrays."""
    out = {}
    for name, meta in metas.items():
        prefix = name + "."
        arr = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        cls = QuantizedEmbedding if meta.get("class") == "QuantizedEmbedding" else QuantizedLinear
        out[name] = cls.from_state(meta, arr)
    return out


def skeleton(model_dir):
    """An mlx-lm model object for ``model_dir``'s config.json with no weights read.

    MLX is lazy: the random initial parameters are never computed, since they are replaced.
    """
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir), lazy=True, strict=False)
    return model


def assemble(model, layers, params, source="artifact"):
    """Put quantized layers and plain params into a skeleton; every tensor must be accounted for."""
    model.update_modules(tree_unflatten(list(layers.items())))
    expected = {k for k, _ in tree_flatten(model.parameters())
                if not any(k.startswith(n + ".") for n in layers)}
    missing, extra = expected - set(params), set(params) - expected
    if missing or extra:
        raise ValueError(f"{source} does not match the model config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(extra)[:5]}")
    model.load_weights(list(params.items()), strict=False)
    return model


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


def reference_logits(model, tokenizer):
    """{"tokens.i", "logits.i"}: float32 logits of each reference prompt, one forward each."""
    out = {}
    for i, tokens in enumerate(reference_tokens(tokenizer)):
        logits = model(tokens[None]).astype(mx.float32)
        mx.eval(logits)
        out[f"tokens.{i}"] = tokens
        out[f"logits.{i}"] = logits[0]
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
        ref = reference_logits(model, tokenizer)
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
    mx.eval(model.parameters())
    fuse_model(model)
    return model, load_tokenizer(path)


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CALIBRATION_TEXTS = ("none", "text")


def calibration_tokens(tokenizer, text="none", windows=16, length=512, seed=0):
    """(tokens [windows, length] or None, provenance dict or None) for a calibration spec.

    ``text``: ``none`` (data-free quantization) or ``text`` (the calibration split of the real
    English text in vqpipe/text.py, disjoint from the evaluation split).
    """
    if text not in CALIBRATION_TEXTS:
        raise ValueError(f"unknown calibration text {text!r}; choose one of {', '.join(CALIBRATION_TEXTS)}")
    if text == "none":
        return None, None
    if windows < 1 or length < 2:
        raise ValueError(f"calibration needs at least 1 window of 2 tokens, got {windows} x {length}")
    from .. import text as corpus

    tokens = corpus.calibration_tokens(tokenizer, windows, length, seed)
    return tokens, {"text": text, "windows": windows, "length": length, "seed": seed,
                    "provenance": corpus.provenance()}


def run(source, out, bits, rotation="auto", seed=0, embeddings=True, lm_head=True, dtype="source",
        progress=print, group_size=None, calibration="none", calib_windows=16, calib_length=512,
        calib_seed=0, damp=None, moments=None, sequential=True):
    from mlx_lm.utils import load

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if group_size is not None and group_size < 1:
        raise ValueError(f"group size must be a positive integer, got {group_size}")
    if damp is not None and not 0 < damp < 1:
        raise ValueError(f"damping must be in (0, 1), got {damp}")
    source = Path(source)
    if not (source / "config.json").is_file():
        raise ValueError(f"source model directory {source} has no config.json")
    manifest.verify(source)  # a download-stage artifact: checked before anything is read
    model, tokenizer = load(str(source), lazy=True)
    tokens, calib = calibration_tokens(tokenizer, calibration, calib_windows, calib_length, calib_seed)
    stored = None
    if moments is not None:
        if tokens is not None:
            raise ValueError("--moments and --calibration text both give calibration; choose one")
        from . import calibrate as mom

        stored, minfo = mom.load(moments)
        calib = {**minfo["calibration"], "moments": str(moments)}
    elif calib is not None:
        calib["sequential"] = sequential
    t0 = time.perf_counter()
    records = quantize_model(model, bits, rotation, seed, embeddings, lm_head, DTYPES[dtype], progress,
                             group_size, tokens, damp, moments=stored, sequential=sequential)
    seconds = time.perf_counter() - t0
    info = {
        "vqpipe_version": __version__, "source": str(source), "bits": bits, "rotation": rotation,
        "seed": seed, "embeddings": embeddings, "lm_head": lm_head, "dtype": dtype,
        "group_size": group_size, "calibration": calib, "damp": damp,
        "quantize_seconds": seconds, "peak_rss_bytes": peak_rss_bytes(), "records": records,
    }
    save_quantized(model, tokenizer, source, out, info)
    progress(f"quantized {len(records)} layers in {seconds:.1f}s, peak RSS {info['peak_rss_bytes'] / 2**20:.0f} MiB -> {out}")
    return info


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vqpipe quantize", description=__doc__.split("\n")[0])
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
    p.add_argument("--calibration", default="none", choices=CALIBRATION_TEXTS,
                   help="none: data-free; text: GPTQ on the calibration split of vqpipe/text.py")
    p.add_argument("--calib-windows", type=int, default=16, help="calibration windows")
    p.add_argument("--calib-length", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration window offsets")
    p.add_argument("--damp", type=float, default=None, help="GPTQ damping, fraction of mean(diag H) (0.01)")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                   help="with --calibration: each block's moments from the already quantized blocks (default); "
                   "--no-sequential: from the full-precision model (one forward pass per block fewer)")
    p.add_argument("--moments", default=None, metavar="DIR",
                   help="GPTQ with the full-precision moments of a calibrate-stage artifact (no forward pass)")
    args = p.parse_args(argv)
    try:
        run(args.source, args.out, args.bits, args.rotation, args.seed, args.embeddings, args.lm_head, args.dtype,
            group_size=args.group_size, calibration=args.calibration, calib_windows=args.calib_windows,
            calib_length=args.calib_length, calib_seed=args.calib_seed, damp=args.damp, moments=args.moments,
            sequential=args.sequential)
    except (ValueError, OSError) as e:  # OSError: e.g. disk full, named with its path
        where = "" if isinstance(e, ValueError) or e.filename else f"writing {args.out}: "
        print(f"vqpipe quantize: error: {where}{e}", file=sys.stderr)
        return 2
    return 0
