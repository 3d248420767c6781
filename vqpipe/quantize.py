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

from . import __version__
from .codebook import BITS, check_bits
from . import manifest
from .fsutil import atomic_dir, save_safetensors
from .qlinear import QuantizedEmbedding, QuantizedLinear
from .rotation import KINDS, resolve_kind

REFERENCE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while the river runs north.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1969 the first people walked on the Moon; the mission lasted eight days.",
    "Quantized weights keep their row norms; the rotation spreads outliers evenly.",
)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_CONFIG_DROP = ("quantization", "quantization_config")


def layer_seed(seed, name):
    """A per-layer seed: stable across processes and Python versions (no hash())."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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
                   dtype=mx.float32, progress=None):
    """Quantize ``model`` in place, one layer at a time; returns per-layer records.

    Every nn.Linear (and affine nn.QuantizedLinear, dequantized first) becomes a QuantizedLinear.
    Embeddings are quantized when ``embeddings`` is true, otherwise kept (dequantized if needed)
    in ``dtype``, like every other tensor that is not quantized.
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
    records = []
    for i, (name, kind) in enumerate(targets):
        t0 = time.perf_counter()
        module = modules.pop(name)
        weight = _dense_weight(module, mx.float32)
        if kind == "dense-embedding":
            new = nn.Embedding(*weight.shape)
            new.weight = weight.astype(dtype)
            mx.eval(new.weight)
        else:
            in_dim = weight.shape[1]
            r = resolve_kind(rotation, in_dim)
            cls = QuantizedEmbedding if kind == "embedding" else QuantizedLinear
            new = cls.from_linear(module, bits, r, layer_seed(seed, name), weight=weight)
            if "bias" in module:
                new.bias = module.bias.astype(dtype)
            mx.eval(new.parameters())
            total = mx.sum(weight * weight).item()
            records.append({
                "name": name, "kind": kind, "shape": list(weight.shape), "rotation": new.rotation.kind,
                "squared_error": new.squared_error, "weight_sq": total,
                "rel_mse": new.squared_error / max(total, 1e-30), "seconds": time.perf_counter() - t0,
            })
        model.update_modules(tree_unflatten([(name, new)]))
        del weight, module, new
        if progress:
            progress(f"[{i + 1}/{len(targets)}] {name} {kind} {time.perf_counter() - t0:.2f}s")
    # Remaining tensors (norms, biases of other layers) in the compute dtype.
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    rest = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
            if not any(k.startswith(q + ".") for q in quantized) and mx.issubdtype(v.dtype, mx.floating)]
    model.load_weights(rest, strict=False)
    mx.eval(model.parameters())
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
    from .bench.env import environment as env

    return env()


def save_quantized(model, tokenizer, source_dir, out_dir, info):
    metas, arrays, params = split_state(model)
    tensors = {f"layers.{k}": v for k, v in arrays.items()}
    tensors.update({f"params.{k}": v for k, v in params.items()})
    with atomic_dir(out_dir, manifest=True) as tmp:
        save_safetensors(tmp / "quantized.safetensors", tensors)
        copy_model_files(source_dir, tmp, {"vqpipe": {k: info[k] for k in ("bits", "rotation", "seed")}})
        (tmp / "quantized.json").write_text(json.dumps({**info, "layers": metas}, indent=2) + "\n")
        ref = reference_logits(model, tokenizer)
        save_safetensors(tmp / "reference.safetensors", ref)
        (tmp / "reference.json").write_text(json.dumps(
            {"prompts": list(REFERENCE_PROMPTS), "environment": environment()}, indent=2) + "\n")


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
    return model, load_tokenizer(path)


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(source, out, bits, rotation="auto", seed=0, embeddings=False, lm_head=True, dtype="float32",
        progress=print):
    from mlx_lm.utils import load

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    source = Path(source)
    if not (source / "config.json").is_file():
        raise ValueError(f"source model directory {source} has no config.json")
    manifest.verify(source)  # a download-stage artifact: checked before anything is read
    model, tokenizer = load(str(source), lazy=True)
    t0 = time.perf_counter()
    records = quantize_model(model, bits, rotation, seed, embeddings, lm_head, DTYPES[dtype], progress)
    seconds = time.perf_counter() - t0
    info = {
        "vqpipe_version": __version__, "source": str(source), "bits": bits, "rotation": rotation,
        "seed": seed, "embeddings": embeddings, "lm_head": lm_head, "dtype": dtype,
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
    p.add_argument("--embeddings", action="store_true", help="also quantize the embedding table")
    p.add_argument("--no-lm-head", dest="lm_head", action="store_false", help="keep an untied lm_head dense")
    p.add_argument("--dtype", default="float32", help="dtype of tensors that stay unquantized")
    args = p.parse_args(argv)
    try:
        run(args.source, args.out, args.bits, args.rotation, args.seed, args.embeddings, args.lm_head, args.dtype)
    except (ValueError, OSError) as e:  # OSError: e.g. disk full, named with its path
        where = "" if isinstance(e, ValueError) or e.filename else f"writing {args.out}: "
        print(f"vqpipe quantize: error: {where}{e}", file=sys.stderr)
        return 2
    return 0
