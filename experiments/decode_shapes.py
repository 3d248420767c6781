"""Decode speed at a synthetic preset's shapes, with weights made on the device (no files, no download).

For presets too large to build and quantize within one GPU run (``llama3-8b``: 8 B parameters),
this measures what bench-decode measures, prefill and decode tok/s per arm, on models built in
memory from the preset's config:

- ``bf16``: mlx-lm's model with random bf16 weights (N(0, 0.02), norms 1);
- ``affine4``: the same weights through MLX's ``nn.quantize`` (affine 4-bit, group 64);
- ``vqpipe-bN``: vqpipe layers (QuantizedLinear / QuantizedEmbedding, the tied or untied head
  included) with **random codes** and per-row scales giving rows of the same norm, the rotations
  vqpipe would use (q/k/v and gate/up sharing one), fused as the loaders fuse them;
- ``vqpipe-bN+rot`` (``--prologue-bits N``): the same model with the rotation in the qmv kernel's
  prologue (``qmv.rotating_in_kernel``) instead of MLX ops before each launch;
- ``vqpipe-bN+u`` (``--unpack-bits N``): the same model with the dense (prefill) path rebuilding
  its weights the old way, unpacking to uint32 before the codebook gather (vqpipe/kernels/dequant.py);
- ``vqpipe-bN-nofold`` (``--unfolded-bits N``): the same codes with the rotation signs not folded
  into the norms and up_proj's scales (vqpipe/layers/fold.py): three more primitives per layer;
- ``vqpipe-bN-res`` (``--residual-bits N``): the same codes laid out as a residual-rotated model
  (vqpipe/quant/residual_rotation.py): q/k/v, gate/up, the embedding and an untied head without rotations
  of their own, a tied head reading its input map: the decode cost of that structure (its text
  differs: the codes mean another function);
- ``vqpipe-bN+x`` / ``vqpipe-bN+xa`` (``--ext-bits N``): the same model with the decode mat-vec of
  the layers of at most ``--ext-max-weights`` weights (``+x``) or of every layer (``+xa``) through
  the compiled extension's primitive (vqpipe/kernels/ext.py, csrc/matvec.cu; the rotation as MLX
  ops before it) instead of ``mx.fast.cuda_kernel``'s launch: the host cost of a C++ primitive
  against a run-time kernel's, and the kernel's speed on small layers;
- ``ARM+c`` (``--compiled``): every arm above once more, decoding through vqpipe.decode.step (one
  compiled step over a static KV cache) instead of mlx-lm's eager ``generate_step``: the same
  weights, so ``X+c`` vs ``X`` is what compilation buys and ``vqpipe-bN+c`` vs ``bf16+c`` what the
  kernel contributes once both are compiled;
- ``ARM+s`` (``--split``): the same through decode_step's split mode (per block two compiled
  functions around MLX's fused attention).

The split step's variants measured here and not adopted (epilogue adds, fused prep kernels,
mlx-lm's views, KV writes by slice_update, pooled small arrays) are listed in docs/tried.md.

``--aa-arm`` picks the arm run twice for the A/A floor (default the eager bf16 arm; a split arm's
spread is several times smaller); ``--split-only`` leaves the eager arms out.

The vqpipe arms carry random codes, not a quantization of the bf16 weights (quantizing 8 B weights
through quantize.py takes longer than one GPU run here): the kernels' speed does not depend on
the code values, but the generated text does, so the text is compared between arms only as a
record, never as a check (quality is measured on models quantized for real: bench-quality). Prompts
are >= 20 distinct random token sequences. Arms run interleaved through ``harness.run_interleaved``
with an A/A copy of the baseline; bytes per token and the roofline use the copy bandwidth measured
in the same process.

    python -m experiments.decode_shapes --preset llama3-8b --out FILE.json
"""

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from vqpipe.kernels import dequant, dispatch, ext, qmv
from vqpipe.sources import synth
from vqpipe.decode.step import Decoder
from vqpipe.codec.codebook import codebook
from vqpipe.store.fsutil import write_json
from vqpipe.layers.fused import fuse_model, rotation_owner
from vqpipe.codec.bitpack import words_per_row
from vqpipe.layers.qlinear import QuantizedEmbedding, QuantizedLinear
from vqpipe.quant import residual_rotation
from vqpipe.quant.quantize import layer_seed, residual_seed
from vqpipe.quant.residual_rotation import Head, tied, unrotated
from vqpipe.codec.rotation import make_rotation
from vqpipe.bench import harness, roofline
from vqpipe.stages.bench_decode import generate_once, make_cache
from vqpipe.bench.env import environment

STD = 0.02
ROT = "+rot"  # arm suffix: the rotation in the kernel's prologue
UNPACK = "+u"  # arm suffix: the old dense-path weight rebuild (uint32 unpack, then gather)
NOFOLD = "-nofold"  # arm suffix: rotation signs not folded (vqpipe/layers/fold.py)
RES = "-res"  # arm suffix: laid out as a residual-rotated model (vqpipe/quant/residual_rotation.py)
COMPILED = "+c"  # arm suffix: decode through vqpipe.decode.step, the whole step compiled
SPLIT = "+s"  # arm suffix: decode_step's split mode (compiled blocks around MLX's fused SDPA)
EXT = "+x"  # arm suffix: small layers' decode mat-vec through the extension's primitive
EXT_ALL = "+xa"  # arm suffix: every layer's decode mat-vec through the extension's primitive
MODES = {COMPILED: "whole", SPLIT: "split"}


@contextlib.contextmanager
def ext_routing(max_weights):
    """Inside the block, a layer's GPU decode mat-vec with at most ``max_weights`` weights (None:
    none) runs as the extension's primitive on the rotated input instead of dispatch.launch's kernel."""
    if max_weights is None:
        yield
        return
    original = dispatch.launch

    def launch(dialect, x, packed, scales, codebook, bits, bias=None, group_size=None, rotation=None, splits=None,
               owner=None):
        if dialect == "cuda" and packed.shape[0] * x.shape[-1] <= max_weights:
            xr = x if rotation is None else rotation.apply(x)
            y = ext.matvec(xr, packed, scales, codebook, bits, bias, group_size)
            return y if splits is None else mx.split(y, list(splits), axis=-1)  # a fused layer's parts
        return original(dialect, x, packed, scales, codebook, bits, bias, group_size, rotation, splits, owner)

    dispatch.launch = launch
    try:
        yield
    finally:
        dispatch.launch = original


def ext_weights(arm, args):
    """The ext routing's weight limit for a model arm (None: not routed)."""
    return math.inf if arm.endswith(EXT_ALL) else args.ext_max_weights if arm.endswith(EXT) else None


def decode_mode(name):
    """decode_step's mode for an arm, or None for mlx-lm's eager decode."""
    name = name.removesuffix(harness.AA_SUFFIX)
    return next((mode for suffix, mode in MODES.items() if name.endswith(suffix)), None)


def model_arm(name):
    """The model an arm decodes with: its name without the A/A and decode-mode suffixes."""
    name = name.removesuffix(harness.AA_SUFFIX)
    return next((name.removesuffix(sfx) for sfx in MODES if name.endswith(sfx)), name)


def is_compiled(name):
    return decode_mode(name) is not None


def skeleton(preset):
    from vqpipe.quant.quantize import skeleton as load_skeleton

    with tempfile.TemporaryDirectory(prefix="vq-shapes-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(synth.make_config(preset)))
        return load_skeleton(tmp)


def random_full(preset, dtype=mx.bfloat16):
    """mlx-lm's model of ``preset`` with random weights, evaluated tensor by tensor."""
    model = skeleton(preset)
    new = []
    for i, (name, v) in enumerate(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            a = mx.ones(v.shape, dtype)
        else:
            a = (mx.random.normal(v.shape, key=mx.random.key(i)) * STD).astype(dtype)
        mx.eval(a)
        new.append((name, a))
    model.load_weights(new, strict=False)
    return model


def affine(full, preset):
    model = skeleton(preset)
    model.load_weights(tree_flatten(full.parameters()), strict=False)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    mx.eval(model.parameters())
    return model


def _random_layer(cls, n_in, n_out, bits, name, key, bias=None, residual=False):
    r = make_rotation("none" if residual and unrotated(name) else "auto", n_in, layer_seed(0, rotation_owner(name)))
    shape = (n_out, words_per_row(n_in, bits))
    packed = mx.random.randint(-(2**31), 2**31 - 1, shape, mx.int32, key=key).view(mx.uint32)
    scales = mx.full((n_out,), STD * math.sqrt(n_in), mx.float32)  # rows of the bf16 arm's norm
    levels = mx.array(codebook(bits, n_in) / math.sqrt(n_in), mx.float32)
    layer = cls(n_in, n_out, bits, r, packed, scales, levels, bias)
    mx.eval(layer.parameters())
    return layer


def random_vqpipe(preset, bits, dtype=mx.bfloat16, fold=True, residual=False):
    """vqpipe layers with random codes in place of every Linear and the embedding; norms 1. The
    codes depend on ``bits`` only, so ``fold=False`` gives the same model unfolded, and
    ``residual`` the same codes as a residual-rotated model (the stream's readers unrotated, a tied
    head reading Head(y) with gain 1)."""
    model = skeleton(preset)
    layers = []
    for i, (name, m) in enumerate(model.named_modules()):
        k = mx.random.key(1000 * bits + i)
        if isinstance(m, nn.Linear):
            bias = mx.zeros((m.weight.shape[0],), dtype) if "bias" in m else None
            layers.append((name, _random_layer(QuantizedLinear, m.weight.shape[1], m.weight.shape[0], bits, name, k,
                                               bias, residual)))
        elif isinstance(m, nn.Embedding):
            emb = _random_layer(QuantizedEmbedding, m.weight.shape[1], m.weight.shape[0], bits, name, k,
                                residual=residual)
            emb.out_dtype = dtype
            if residual and tied(model):
                q = make_rotation("auto", emb.in_features, residual_seed(0))
                emb.head = Head(mx.ones((emb.in_features,), dtype), q)
                residual_rotation.mark(model, residual_rotation.identity(q))
            layers.append((name, emb))
    from mlx.utils import tree_unflatten

    model.update_modules(tree_unflatten(layers))
    quantized = {n for n, _ in layers}
    rest = [(k, mx.ones(v.shape, dtype)) for k, v in tree_flatten(model.parameters())
            if not any(k.startswith(q + ".") for q in quantized)]
    model.load_weights(rest, strict=False)
    mx.eval(model.parameters())
    fuse_model(model, fold=fold)
    return model


def weight_bytes(model, config):
    """Weight bytes one decode token reads: every parameter, an untied embedding as one row, and
    vqpipe rotations (signs, Kronecker factors; not MLX parameters)."""
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if not config.get("tie_word_embeddings", False):
        emb = model.model.embed_tokens
        table = sum(v.nbytes for _, v in tree_flatten(emb.parameters()) if v.ndim >= 1 and v.shape[0] == config["vocab_size"])
        total -= table - table // config["vocab_size"]
    rot = {id(m.rotation): m.rotation.matrix_bytes() for _, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    return int(total + sum(rot.values()))


VIEWS = {"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Slice", "Transpose", "AsStrided", "Split", "Depends",
         "StopGradient", "Flatten", "Unflatten"}  # primitives MLX evaluates without launching a kernel


def graph_ops(out):
    """Primitives in the graph that computes ``out`` (its unevaluated part), by name, from
    ``mx.export_to_dot``; views (``VIEWS``) are counted apart."""
    with tempfile.TemporaryDirectory(prefix="vq-dot-") as tmp:
        path = Path(tmp) / "g.dot"
        mx.export_to_dot(str(path), out)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text())
    counts = {}
    for name in labels:
        counts[name] = counts.get(name, 0) + 1
    views = sum(n for k, n in counts.items() if k in VIEWS)
    return {"ops": len(labels) - views, "views": views, "by_primitive": dict(sorted(counts.items()))}


def _eager_step(model, prompt):
    cache = make_cache(model, "fp", 4, 32, 0)
    mx.eval(model(prompt[None], cache=cache))
    tok = mx.array([[1]])
    return lambda: model(tok, cache=cache)


def _compiled_step(model, prompt, steps, mode, **options):
    dec = Decoder(model, prompt.size + steps + 2, mode, **options)
    tok, pos, state = dec.start(prompt)
    st = {"state": state, "pos": pos}
    del state

    def step():
        nxt, st["pos"], st["state"], _ = dec.step(tok, st["pos"], st["state"])
        return nxt
    step()  # the trace: once, before anything is timed
    mx.eval(st["state"])
    return step


def step_profile(model, vocab, rot=False, context=64, steps=8, mode=None, tables=True, ext_max=None, **options):
    """One decode step, unpipelined: host time to build its graph (Python; for a compiled step, the
    C++ replay of its trace), to encode it (``mx.async_eval`` returns once the kernels are queued)
    and the whole step to ``mx.synchronize``, median over ``steps``; plus the graph's primitives
    (:func:`graph_ops`). Where build + encode exceeds what the GPU needs, decode is bound by the
    host (docs/decode.md)."""
    with qmv.rotating_in_kernel(rot), dequant.using_tables(tables), ext_routing(ext_max):
        prompt = mx.random.randint(0, vocab - 16, (context,), key=mx.random.key(7))
        step = _compiled_step(model, prompt, steps, mode, **options) if mode else _eager_step(model, prompt)
        build, encode, total = [], [], []
        for _ in range(steps):
            mx.synchronize()
            t0 = time.perf_counter()
            logits = step()
            t1 = time.perf_counter()
            mx.async_eval(logits)
            t2 = time.perf_counter()
            mx.synchronize()
            t3 = time.perf_counter()
            build.append(t1 - t0), encode.append(t2 - t1), total.append(t3 - t0)
        ops = graph_ops(step())
    med = harness.summarize
    return {"context": context, "build_s": med(build), "encode_s": med(encode), "step_s": med(total), **ops}


def run(args, progress=print):
    t_start = time.perf_counter()
    config = synth.make_config(args.preset)
    copy = roofline.measure_copy_bandwidth(args.copy_mib << 20)
    progress(f"copy bandwidth: {copy['median'] / 1e9:.1f} GB/s [{copy['min'] / 1e9:.1f}-{copy['max'] / 1e9:.1f}], n={copy['n']}")
    models = {"bf16": random_full(args.preset)}
    models["affine4"] = affine(models["bf16"], args.preset)
    for b in args.bits:
        models[f"vqpipe-b{b}"] = random_vqpipe(args.preset, b)
    for b in args.prologue_bits:  # the same model object: only the kernel's rotation differs
        models[f"vqpipe-b{b}{ROT}"] = models.get(f"vqpipe-b{b}") or random_vqpipe(args.preset, b)
    for b in args.unpack_bits:  # the same model object: only the dense path's weight rebuild differs
        models[f"vqpipe-b{b}{UNPACK}"] = models.get(f"vqpipe-b{b}") or random_vqpipe(args.preset, b)
    for b in args.ext_bits:  # the same model object: only the decode mat-vec's kernel differs
        models[f"vqpipe-b{b}{EXT}"] = models.get(f"vqpipe-b{b}") or random_vqpipe(args.preset, b)
        models[f"vqpipe-b{b}{EXT_ALL}"] = models[f"vqpipe-b{b}{EXT}"]
    for b in args.unfolded_bits:
        models[f"vqpipe-b{b}{NOFOLD}"] = random_vqpipe(args.preset, b, fold=False)
    for b in args.residual_bits:
        models[f"vqpipe-b{b}{RES}"] = random_vqpipe(args.preset, b, residual=True)
    kvpp = roofline.kv_bytes_per_position(config, 2)
    info = {name: {"weight_bytes": weight_bytes(m, config)} for name, m in models.items()}
    for name, i in info.items():
        progress(f"built {name}: {i['weight_bytes'] / 2**30:.2f} GiB read per token (weights)")
    plain = list(models)
    arm_names = ([] if args.split_only else plain) + ([n + COMPILED for n in plain] if args.compiled else []) + \
        ([n + SPLIT for n in models] if args.split or args.split_only else [])
    if args.aa_arm not in arm_names:
        raise ValueError(f"--aa-arm {args.aa_arm!r} is not one of the arms: {arm_names}")
    info.update({n: info[model_arm(n)] for n in arm_names})
    profiles, skipped = {}, {}
    for name in list(arm_names):
        m = models[model_arm(name)]
        try:
            profiles[name] = p = step_profile(m, config["vocab_size"], model_arm(name).endswith(ROT), mode=decode_mode(name),
                                              tables=not model_arm(name).endswith(UNPACK),
                                              ext_max=ext_weights(model_arm(name), args))
        except Exception as e:  # a compiled arm that cannot trace is reported, not fatal to the eager arms
            if not is_compiled(name):
                raise
            skipped[name] = f"{type(e).__name__}: {e}"
            arm_names.remove(name)
            progress(f"step {name}: skipped ({skipped[name]})")
            continue
        progress(f"step {name}: {p['ops']} ops ({p['views']} views), build {p['build_s']['median'] * 1e3:.2f} ms, "
                 f"encode {p['encode_s']['median'] * 1e3:.2f} ms, step {p['step_s']['median'] * 1e3:.2f} ms (unpipelined)")
        if args.attribution and is_compiled(name):  # host vs GPU time of the compiled step (experiments/step_attribution.py)
            from experiments.step_attribution import line, timing

            p.update(timing(m, config["vocab_size"], decode_mode(name), model_arm(name).endswith(ROT),
                            context=args.prompt_lengths[0]))
            progress("  attribution " + line(name, {**p, "profile": p}))
    baseline = args.aa_arm
    aa = baseline + harness.AA_SUFFIX
    records, comparisons, texts = [], [], []

    def result():
        return {"kind": "bench-decode-shapes", "preset": args.preset, "config": config, "environment": environment(),
                "settings": {k: v for k, v in vars(args).items() if k != "out"}, "copy_bandwidth": copy,
                "mlx_env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "VQPIPE_"))},
                "kv_bytes_per_position": kvpp, "weights": info, "step_profile": profiles, "records": records, "comparisons": comparisons,
                "texts": texts, "skipped_arms": skipped, "wall_s": time.perf_counter() - t_start}

    for P in [] if args.profile_only else args.prompt_lengths:
        prompts = [mx.random.randint(0, config["vocab_size"] - 16, (P,), key=mx.random.key(1000 * P + k))
                   for k in range(args.prompts)]
        log = {name: [] for name in [*arm_names, aa]}
        decoders = {n: Decoder(models[model_arm(n)], P + max(args.gen_tokens, 8), decode_mode(n))
                    for n in arm_names if is_compiled(n)}

        def call(name, k, n_tokens):
            model = models[model_arm(name)]
            arm = model_arm(name)
            with qmv.rotating_in_kernel(arm.endswith(ROT)), dequant.using_tables(not arm.endswith(UNPACK)), \
                    ext_routing(ext_weights(arm, args)):
                if is_compiled(name):
                    out = decoders[name.removesuffix(harness.AA_SUFFIX)].generate(prompts[k], n_tokens, args.prefill_step)
                else:
                    out = generate_once(model, prompts[k], make_cache(model, "fp", 4, 32, 0), n_tokens, args.prefill_step)
            log[name].append({"prompt": k, **out})
            return mx.array(out["ids"])

        for name in arm_names:  # warm-up: every kernel compiled and every step traced before anything is timed
            call(name, 0, 8)
        for name in log:
            log[name].clear()
        arms = {name: (lambda i, name=name: call(name, 1 + i % (args.prompts - 1), args.gen_tokens)) for name in arm_names}
        arms[aa] = lambda i: call(aa, 1 + i % (args.prompts - 1), args.gen_tokens)
        harness.run_interleaved(arms, args.prompts, args.repeats, warmup=0)
        samples = {n: {ph: [e[f"{ph}_s"] for e in log[n]] for ph in ("prefill", "decode")} for n in log}
        floor = {ph: harness.noise_floor(samples[baseline][ph], samples[aa][ph]) for ph in ("prefill", "decode")}
        mean_ctx = P + (args.gen_tokens + 1) / 2
        for name in arm_names:
            for phase, toks in (("prefill", P), ("decode", args.gen_tokens)):
                rate = harness.summarize([toks / s for s in samples[name][phase]])
                rec = {"arm": name, "phase": phase, "context": P, "unit": "tok/s", **rate, "noise_floor": floor[phase]}
                if phase == "decode":
                    bpt = roofline.decode_bytes_per_token(info[name]["weight_bytes"], kvpp, mean_ctx)
                    rec["bytes_per_token"] = bpt
                    rec["achieved"] = {k: roofline.achieved(bpt, rate[k], copy["median"]) for k in ("median", "min", "max")}
                records.append(rec)
                progress(f"P={P} {phase:>7} {name:>12}: {rate['median']:8.1f} tok/s [{rate['min']:.1f}-{rate['max']:.1f}] n={rate['n']}"
                         + (f", {rec['bytes_per_token'] / 2**30:.2f} GiB/token = "
                            f"{rec['achieved']['median']['percent_of_peak']:.1f}% of copy" if phase == "decode" else ""))
            for phase in ("prefill", "decode"):
                arm = model_arm(name)
                bases = [baseline, "affine4"] + [arm.removesuffix(sfx) for sfx in (ROT, UNPACK, NOFOLD, RES, EXT, EXT_ALL) if arm.endswith(sfx)]
                if is_compiled(name):  # against its eager self, and the baselines in the same mode
                    sfx = name[len(model_arm(name)):]
                    bases += [model_arm(name), baseline + sfx, "bf16" + sfx, "affine4" + sfx]
                    bases += [arm.removesuffix(x) + sfx for x in (NOFOLD, RES) if arm.endswith(x)]  # same mode
                    if sfx == SPLIT:
                        bases.append(model_arm(name) + COMPILED)
                for base in dict.fromkeys(bases):
                    if name != base and base in log:
                        cmp = harness.compare(samples[base][phase], samples[name][phase], floor[phase])
                        comparisons.append({"context": P, "phase": phase, "baseline_arm": base, "other_arm": name, **cmp})
                        progress(f"  P={P} {phase}: {name} vs {base}: {cmp['text']}")
        for name in arm_names:  # a record only: the vqpipe arms' codes are random (see the docstring)
            same = [a["ids"] == b["ids"] for a, b in zip(log[baseline], log[name])]
            texts.append({"context": P, "a": baseline, "b": name, "identical_ids": sum(same), "pairs": len(same)})
            base = next((model_arm(name).removesuffix(sfx) for sfx in (UNPACK, NOFOLD) if model_arm(name).endswith(sfx)), None)
            if base is not None and not is_compiled(name):  # exact rewrites: the same ids expected
                same = [a["ids"] == b["ids"] for a, b in zip(log[base], log[name])]
                texts.append({"context": P, "a": base, "b": name, "identical_ids": sum(same), "pairs": len(same),
                              "what": "exact rewrite (fold / weight rebuild), same weights"})
            if is_compiled(name) and model_arm(name) != baseline and model_arm(name) in log:  # compiled vs eager, same weights
                same = [a["ids"] == b["ids"] for a, b in zip(log[model_arm(name)], log[name])]
                texts.append({"context": P, "a": model_arm(name), "b": name, "identical_ids": sum(same), "pairs": len(same),
                              "what": "compiled step vs eager mlx-lm, same weights"})
        texts.append({"context": P, "a": baseline, "b": aa, "identical_ids": sum(a["ids"] == b["ids"] for a, b in zip(log[baseline], log[aa])),
                      "pairs": len(log[aa]), "what": "A/A: the baseline run twice (determinism)"})
        if args.out:  # after every prompt length: a run cut short keeps what it measured
            write_json(args.out, result())
    return result()


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.decode_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=list(synth.PRESETS))
    p.add_argument("--out", required=True)
    p.add_argument("--bits", type=int, nargs="+", default=[4], choices=(2, 3, 4))
    p.add_argument("--prologue-bits", type=int, nargs="*", default=[], choices=(2, 3, 4),
                   help=f"add a vqpipe-bN{ROT} arm per N: the rotation in the kernel's prologue")
    p.add_argument("--unpack-bits", type=int, nargs="*", default=[], choices=(2, 3, 4),
                   help=f"add a vqpipe-bN{UNPACK} arm per N: the old dense-path weight rebuild (prefill A/B)")
    p.add_argument("--ext-bits", type=int, nargs="*", default=[], choices=(2, 3, 4),
                   help=f"add vqpipe-bN{EXT} and vqpipe-bN{EXT_ALL} arms per N: decode mat-vecs through the extension")
    p.add_argument("--ext-max-weights", type=int, default=1 << 21,
                   help=f"the largest layer (out x in weights) the {EXT} arm routes to the extension")
    p.add_argument("--unfolded-bits", type=int, nargs="*", default=[], choices=(2, 3, 4),
                   help=f"add a vqpipe-bN{NOFOLD} arm per N: rotation signs not folded (decode A/B)")
    p.add_argument("--residual-bits", type=int, nargs="*", default=[], choices=(2, 3, 4),
                   help=f"add a vqpipe-bN{RES} arm per N: the same codes laid out as a residual-rotated model")
    p.add_argument("--aa-arm", default="bf16", help="the arm run twice for the A/A noise floor (default bf16, eager)")
    p.add_argument("--split-only", action="store_true", help="split-mode arms only (no eager arms)")
    p.add_argument("--compiled", action="store_true",
                   help=f"add an ARM{COMPILED} arm per arm: decode through vqpipe.decode.step's compiled step")
    p.add_argument("--split", action="store_true",
                   help=f"add an ARM{SPLIT} arm per arm: decode_step's split mode (compiled blocks, fused SDPA between)")
    p.add_argument("--profile-only", action="store_true", help="the step profiles only, no timed generations")
    p.add_argument("--attribution", action="store_true",
                   help="per compiled arm, host vs GPU time per step at the first prompt length (experiments/step_attribution.py)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prefill-step", type=int, default=2048)
    p.add_argument("--copy-mib", type=int, default=1024)
    args = p.parse_args(argv)
    if args.prompts < 20:
        p.error("--prompts must be >= 20")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    write_json(args.out, result)
    print(f"bench-decode-shapes: wrote {args.out} ({result['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
