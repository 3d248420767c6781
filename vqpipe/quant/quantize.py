"""Model-level quantization: every nn.Linear (and, optionally, embedding) of an mlx-lm model
becomes a QuantizedLinear, in place, one layer at a time; and the inverse bookkeeping
(split a quantized model into stored state, rebuild it on a config skeleton).

The quantize stage (vqpipe/stages/quantize.py) wraps this in an artifact; bench-quality, the
reservoir loader and the fuzzers call it directly.
"""

import contextlib
import hashlib
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..codec import allocate
from . import recipe, tune
from .calibrate import calibration_tokens, full_precision_moments, quantize_calibrated
from .config import QuantizeConfig
from ..layers.fused import fuse_model, rotation_owner
from ..parallel import Pool
from .plain_model import plain_model
from ..prefault import large_blocks_on_heap
from ..layers.qlinear import QuantizedEmbedding, QuantizedLinear, dense_weight, trellis_fits
from .residual_rotation import rotate_residual, tied, unrotated
from ..codec.rotation import make_rotation, resolve_kind


def layer_seed(seed, name):
    """A per-layer seed: stable across processes and Python versions (no hash())."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def layer_rotation(rotation, seed, name, in_dim):
    """The rotation quantize_model gives layer ``name`` (``in_dim`` inputs; ``rotation`` a kind)."""
    return make_rotation(resolve_kind(rotation, in_dim), in_dim, layer_seed(seed, rotation_owner(name)))


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


def quantize_model(model, config=None, *, tokenizer=None, calibration=None, moments=None, fisher=None,
                   tune_tokens=None, summary=None, progress=None):
    """Quantize ``model`` in place, one layer at a time, as ``config`` (a QuantizeConfig; None: its
    defaults, the quantize CLI's) says; returns per-layer records.

    Every nn.Linear (and affine nn.QuantizedLinear, dequantized first) becomes a QuantizedLinear;
    the embedding too with ``config.embeddings``, otherwise it is kept (dequantized if needed) in
    ``config.dtype``, like every other tensor that is not quantized. Linears that read the same
    activation (q/k/v, gate/up) share one rotation (the seed of the first: vqpipe/layers/fused.py),
    and with ``config.fuse`` they are computed as one, as the loaders do. ``config.threads`` > 1 runs
    the numpy work of group scales / GPTQ on that many threads, beside the MLX work of the next
    layers (vqpipe/parallel.py); the result is the same.

    Calibration data: ``calibration`` (int tokens [n, length]), or ``moments`` ({name: (key, H)})
    and ``fisher`` from a calibrate artifact (vqpipe/store/calibration.py ``load`` / ``load_fisher``:
    no forward pass). Without either, ``config.calib_text`` says where tokens come from: 'auto' (the
    default, as the CLI for a model that is not synthetic) and 'text' the shipped text, 'self' text
    the model writes, each ``calib_windows`` x ``calib_length`` through ``tokenizer``
    (vqpipe/quant/calibrate.py ``calibration_tokens``); 'none' is data-free, every layer at
    ``config.bits``. A text with no tokenizer is a ValueError, not a silent data-free run: the CLI
    always has the tokenizer, and data-free costs much of the quality, so it is asked for by name.

    The recipe (docs/quantize.md, "The automatic recipe"): with calibration data and not
    ``config.sequential``, the moments come from the full-precision model and each layer's width
    from vqpipe/quant/recipe.py: the steps of one or two bits with the largest predicted loss saved
    per stored bit, within ``config.budget`` bits per weight over every quantized matrix ('auto':
    ``bits`` + 0.5, what MLX affine g64 stores; 'none': every layer at ``bits``).
    ``config.layer_bits`` rules (vqpipe/codec/allocate.py) replace the allocation.

    Tuning (vqpipe/quant/tune.py): with ``config.tune_steps`` and calibration tokens (``tune_tokens``,
    else ``calibration`` or the text's), the row scales are tuned against a float32 copy
    of the source made before quantizing; ``summary`` (a dict), if given, receives its record
    under "tune" (None when it did not run).

    ``config.residual``: first fold one rotation of the residual stream into the model
    (vqpipe/quant/residual_rotation.py; its seed from ``config.seed``, kind from ``config.rotation``);
    the layers that read the stream and the embedding are then quantized without a rotation of
    their own. Needs rotation auto, hadamard or kron, and, for a tied head, ``embeddings``.
    """
    config = QuantizeConfig() if config is None else config
    if not isinstance(config, QuantizeConfig):
        raise TypeError(f"config must be a QuantizeConfig, got {type(config).__name__}")
    bits, rotation, seed, dtype = config.bits, config.rotation, config.seed, _mx_dtype(config.dtype)
    if calibration is None and moments is None:  # from the model before a residual rotation, as the stage
        calibration = _calibration_tokens(model, tokenizer, config)
    if tune_tokens is None:
        tune_tokens = calibration
    teacher, tune_steps = None, tune.steps_for(config.tune_steps, bits)
    if tune_steps and tune_tokens is not None:
        teacher = tune.teacher_of(model)  # before any weight changes (a residual rotation among them)
    if config.residual:
        rotate_for_quantize(model, rotation, seed, config.embeddings)
    targets = _targets(model, config.embeddings, config.lm_head)
    if not any(kind == "linear" for _, _, kind in targets):
        raise ValueError(f"model {type(model).__name__} has no nn.Linear layers to quantize")
    budget, layer_bits = recipe.check_budget(config.budget, bits), config.layer_bits
    if calibration is not None and not config.sequential:  # as the calibrate stage: one full-precision pass
        moments, fisher = calibrate_model(model, calibration, progress, fisher is None and budget is not None and not layer_bits)
        calibration = None
    # Keep names only: holding the source modules would keep every evaluated source weight alive.
    targets = [(name, kind) for name, _, kind in targets]

    def kind_of(name):  # the rotation kind layer ``name`` is quantized with
        return "none" if config.residual and unrotated(name) else rotation

    def rotation_of(name, dim):
        return layer_rotation(kind_of(name), seed, name, dim)

    if layer_bits or fisher is None or moments is None or budget is None:
        layer_bits = allocate.resolve(layer_bits or [], [n for n, kind in targets if kind != "dense-embedding"], bits)
    else:
        layer_bits = _allocate(model, bits, targets, moments, fisher, budget, rotation_of, config.group_size,
                               config.damp, progress, config.codes)
    pool = Pool(config.threads)
    quantize_one = _layer_quantizer(model, bits, layer_bits, kind_of, seed, dtype, config.group_size, config.damp,
                                    pool, progress if calibration is None else None, len(targets), config.codes)
    # With moments, each block makes and frees d x d matrices of 95 MB (a 4864-wide input): kept
    # on the heap and reused instead of mapped afresh (vqpipe/prefault.py; the same bytes)
    heap = large_blocks_on_heap() if calibration is not None or moments is not None else contextlib.nullcontext()
    with pool, heap:
        records = _quantize_all(model, targets, quantize_one, moments, calibration, progress, config.sequential,
                                rotation_of)
    tuned = None
    if teacher is not None:
        tuned = tune.tune(model, teacher, tune_tokens, tune_steps, config.tune_lr, config.tune_length,
                          progress=progress)
        del teacher
    if summary is not None:
        summary["tune"] = tuned
    _cast_rest(model, dtype)
    mx.eval(model.parameters())
    if config.fuse:
        fuse_model(model)
    return [r for r in records if r is not None]


def _mx_dtype(name):
    return None if name is None else getattr(mx, name)


def _calibration_tokens(model, tokenizer, config):
    """The tokens ``config``'s calibration text makes through ``tokenizer`` (None: data-free)."""
    text = config.calib_text
    if text == "none":
        return None
    if tokenizer is None:
        raise ValueError(f"calib_text {text!r} needs the model's tokenizer: pass tokenizer= (the quantize CLI "
                         "calibrates on the shipped text), calibration= tokens or moments=, or set "
                         "QuantizeConfig(calib_text='none') for data-free quantization")
    text = "text" if text == "auto" else text
    tokens, _ = calibration_tokens(tokenizer, text, config.calib_windows, config.calib_length, config.calib_seed, model)
    return tokens


def _allocate(model, bits, targets, moments, fisher, budget, rotation_of, group_size, damp, progress, codes="scalar"):
    """{name: width} of the layers the recipe puts above ``bits`` (vqpipe/quant/recipe.py)."""
    t0 = time.perf_counter()
    chosen, tables, weights = recipe.plan(model, bits, targets, moments, fisher, budget, rotation_of, group_size, damp,
                                          codes)
    layer_bits = {n: w for n, w in chosen.items() if w != bits}
    if progress:
        spent = sum(tables[n][w][0] for n, w in chosen.items()) / weights
        progress(f"allocation: {len(layer_bits)} of {len(chosen)} layers above {bits} bits, {spent:.5f} of "
                 f"{budget} bits per weight, {time.perf_counter() - t0:.1f}s")
    return layer_bits


def _layer_quantizer(model, bits, layer_bits, kind_of, seed, dtype, group_size, damp, pool, progress, n_targets,
                     codes="scalar"):
    """``quantize_one(name, kind, hessian, defer=False)``: replaces layer ``name`` of ``model`` and
    returns its record; with ``defer``, a function that completes the layer and returns its record,
    while the layer's numpy work runs on ``pool`` meanwhile."""
    modules = dict(model.named_modules())
    done = [0]

    def quantize_one(name, kind, hessian, defer=False):
        t0 = time.perf_counter()
        module = modules.pop(name)
        keep = dtype or _source_dtype(module)
        # In the source dtype: quantize_weight casts row chunks to float32, so a 150k-row embedding
        # never has a whole float32 copy (nor a squared one) alive at once.
        weight = dense_weight(module, keep)
        if kind == "dense-embedding":
            new = nn.Embedding(*weight.shape)
            new.weight = weight.astype(keep)
            mx.eval(new.weight)
            finish, gs = (lambda: new), None
        else:
            in_dim = weight.shape[1]
            # one seed for the linears reading one activation: they can share its rotation
            r, r_seed = resolve_kind(kind_of(name), in_dim), layer_seed(seed, rotation_owner(name))
            given = getattr(hessian, "rotation", None)  # moments rotated already (calibrate.collect)
            if given is not None and (given.kind, given.dim, given.seed) == (r, in_dim, r_seed):
                r = given  # the same rotation, not built twice (a mismatch is gptq.rotate_hessian's error)
            cls = QuantizedEmbedding if kind == "embedding" else QuantizedLinear
            # an embedding gets group scales only as a calibrated tied head (vqpipe/quant/calibrate.py)
            gs = group_size if kind == "linear" or hessian is not None else None
            width = layer_bits.get(name, bits)
            layer_codes = "trellis" if codes == "trellis" and trellis_fits(width, *weight.shape, gs) else "scalar"
            finish = cls.from_linear(module, width, r, r_seed, weight=weight, group_size=gs, hessian=hessian,
                                     damp=damp, pool=pool, codes=layer_codes)

        def complete():  # MLX from here on: on this (the main) thread
            new = finish()
            record = None
            if kind != "dense-embedding":
                if kind == "embedding":
                    new.out_dtype = keep
                    new.head = getattr(module, "head", None)  # a residual-rotated tied head's input map
                if "bias" in module:
                    new.bias = module.bias.astype(dtype or module.bias.dtype)
                mx.eval(new.parameters())
                total = _sum_squares(weight)
                record = {
                    "name": name, "kind": kind, "shape": list(weight.shape), "bits": new.bits, "codes": new.codes,
                    "rotation": new.rotation.kind, "group_size": gs, "calibrated": hessian is not None,
                    "squared_error": new.squared_error, "weight_sq": total,
                    "rel_mse": new.squared_error / max(total, 1e-30), "seconds": time.perf_counter() - t0,
                }
            model.update_modules(tree_unflatten([(name, new)]))
            done[0] += 1
            if progress:
                progress(f"[{done[0]}/{n_targets}] {name} {kind} {time.perf_counter() - t0:.2f}s")
            return record

        return complete if defer else complete()

    return quantize_one


def _cast_rest(model, dtype):
    """The tensors that are not quantized (norms, biases of other layers) in ``dtype`` (None: kept)."""
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    rest = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
            if not any(k.startswith(q + ".") for q in quantized) and mx.issubdtype(v.dtype, mx.floating)
            and dtype is not None and v.dtype != dtype]
    if rest:
        model.load_weights(rest, strict=False)


def calibrate_model(model, tokens, progress=None, sensitivity=True):
    """({name: (key, H)}, fisher or None): the full-precision moments of ``tokens`` (the calibrate
    stage's) and, with ``sensitivity``, the output Fisher of its first recipe.FISHER_WINDOWS windows."""
    names, sums = full_precision_moments(model, tokens, progress)
    stored = {name: (key, sums[key]) for name, key in names.items()}
    fisher = None
    if sensitivity:
        fisher = recipe.output_fisher(model, tokens[: recipe.FISHER_WINDOWS], recipe.sensitive_layers(model), progress,
                                      tokens.size)
    return stored, fisher


def residual_seed(seed):
    """The residual rotation's seed for quantize seed ``seed`` (the calibrate stage derives it too)."""
    return layer_seed(seed, "residual stream")


def residual_identity(model, rotation, seed):
    """The identity (vqpipe/quant/residual_rotation.py) of the residual rotation :func:`rotate_for_quantize`
    folds into ``model``, known before it does."""
    hidden = int(model.args.hidden_size)
    return {"kind": resolve_kind(rotation, hidden), "dim": hidden, "seed": residual_seed(seed)}


def rotate_for_quantize(model, rotation, seed, embeddings=True):
    """Fold the residual rotation quantize_model uses with ``residual`` into ``model``; returns it."""
    if rotation not in ("auto", "hadamard", "kron"):
        raise ValueError(f"a residual rotation is folded with rotation auto, hadamard or kron, not {rotation!r}")
    if tied(model) and not embeddings:
        raise ValueError("a residual rotation of a model with a tied head needs its embedding quantized "
                         "(the table's rows are rotated and the head reads them through the stored Head)")
    return rotate_residual(model, residual_seed(seed), rotation)


LOOKAHEAD = 3  # layers prepared (rotated, factorised) while earlier ones' numpy work runs


def _quantize_all(model, targets, quantize_one, moments, calibration, progress, sequential, rotation):
    """Every target's record, in order: with stored ``moments`` or ``calibration`` tokens, or data-free."""
    if moments is not None:  # {name: (key, H)} from a calibrate artifact (vqpipe/stages/calibrate.py)
        records, pending = [], []

        def complete_first():
            key, complete = pending.pop(0)
            records.append(complete())
            if key is not None:
                records[-1]["hessian"] = key

        for name, kind in targets:
            key, hess = moments.get(name, (None, None)) if kind != "dense-embedding" else (None, None)
            pending.append((key if hess is not None else None, quantize_one(name, kind, hess, defer=True)))
            if len(pending) > LOOKAHEAD:
                complete_first()
        while pending:
            complete_first()
        return records
    if calibration is None:
        return [quantize_one(name, kind, None) for name, kind in targets]
    return quantize_calibrated(model, calibration, quantize_one, targets, progress, sequential, rotation=rotation)


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
    Built without mlx_lm.utils where that gives the same model (vqpipe/quant/plain_model.py).
    """
    model = plain_model(model_dir)
    if model is None:
        from mlx_lm.utils import load_model

        model, _ = load_model(Path(model_dir), lazy=True, strict=False)
    return model


def restore_head(model, has_head):
    """Give back the lm_head a skeleton dropped, where the artifact ``has_head``. Some mlx-lm models decide tying by the weights they
    are given, not by config.json (gemma3_text's ``sanitize`` pops ``lm_head`` when no
    ``lm_head.weight`` comes): built without weights, they are tied; an artifact that holds a head
    unties them."""
    if not has_head or "lm_head" in model:
        return
    if getattr(model, "tie_word_embeddings", None) is not True:
        return
    vocab, hidden = model.model.embed_tokens.weight.shape
    model.lm_head = nn.Linear(hidden, vocab, bias=False)  # lazy: replaced before it is computed
    model.tie_word_embeddings = False


def assemble(model, layers, params, source="artifact"):
    """Put quantized layers and plain params into a skeleton; every tensor must be accounted for."""
    restore_head(model, "lm_head" in layers or "lm_head.weight" in params)
    model.update_modules(tree_unflatten(list(layers.items())))
    expected = {k for k, _ in tree_flatten(model.parameters())
                if not any(k.startswith(n + ".") for n in layers)}
    missing, extra = expected - set(params), set(params) - expected
    if missing or extra:
        raise ValueError(f"{source} does not match the model config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(extra)[:5]}")
    model.load_weights(list(params.items()), strict=False)
    return model
