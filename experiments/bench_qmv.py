"""bench-qmv: the fused codebook mat-vec (vqpipe/kernels/qmv.py) against dense and MLX affine mat-vecs.

Per layer shape (Qwen2.5-0.5B and Llama-style), with one activation row (M = 1, decode), the arms run
interleaved in one process on rotating pools of >= 20 distinct activations and of distinct weight
copies (enough copies that one pass over a pool exceeds ``--flush-mib``, so large shapes stream
from memory instead of hitting the L2 cache; capped at ``--max-pool`` copies):

- ``dense-fp16``, ``dense-bf16``: ``x @ W.T`` with a dense weight of the same shape;
- ``affine4``: ``mx.quantized_matmul`` (MLX affine 4-bit, group 64), x in ``--dtype``;
- ``vq-ref``: ``QuantizedLinear`` with the kernel switched off (rotation, then the dense path that
  rebuilds C[q] every call);
- ``vq-kernel``: ``QuantizedLinear`` with the kernel (rotation, then the fused mat-vec);
- ``vq-core``: the fused mat-vec alone on an already rotated activation;
- ``vq-core-N`` (``--core-blocks N ...``): ``vq-core`` with at most N threadgroups;
- ``vq-core-stN`` (``--core-stages N ...``): ``vq-core`` with an N-stage ring (N - 1 chunks ahead; 0:
  the next chunk in registers);
- ``vq-rot-N`` (``--prologue-blocks N ...``): the layer with the rotation in the kernel's prologue,
  at most N threadgroups (each redoes the rotation, then takes row sets grid-stride).

The kernel arms need a Metal/CUDA backend; without one they are skipped and the reason recorded.
Three modes: ``isolated`` (one call per timed step: each sample carries a whole eval + synchronize),
``chained`` (``--calls`` calls per step, each call's input made to depend on the previous call's
output by one elementwise add, as consecutive layers of a decode step depend on each other) and
``independent`` (``--calls`` independent calls per step: throughput). Per-call figures are step
times / calls. A second copy of the subject arm (``vq-kernel``, or ``vq-ref`` without a GPU) gives
the A/A noise floor. Bytes per call are the fewest any implementation must read and write (the
weights as stored, activation, output), so GB/s compares arms on the same footing; the copy
bandwidth is measured in the same process.

    python -m experiments.bench_qmv --out results/bench/qmv.json
"""

import argparse
import math
import sys

import mlx.core as mx

from vqpipe.kernels import qmv
from vqpipe.codec.codebook import codebook
from vqpipe.store.fsutil import write_json
from vqpipe.codec.bitpack import words_per_row
from vqpipe.layers.qlinear import QuantizedLinear
from vqpipe.codec.rotation import make_rotation
from vqpipe.bench import env, harness, roofline

# name -> (in_features, out_features)
SHAPES = {
    "qwen-q/o": (896, 896),
    "qwen-k/v": (896, 128),
    "qwen-up/gate": (896, 4864),
    "qwen-down": (4864, 896),
    "qwen-lm_head": (896, 151936),
    "llama2k-attn": (2048, 2048),
    "llama2k-up": (2048, 5632),
    "llama4k-attn": (4096, 4096),
    "llama4k-up": (4096, 11008),
    "llama4k-down": (11008, 4096),
    # fused projections (rows concatenated, vqpipe/layers/fused.py) and Llama-3-8B's layers
    "qwen-qkv": (896, 1152),
    "qwen-gateup": (896, 9728),
    "l3-qkv": (4096, 6144),
    "l3-o": (4096, 4096),
    "l3-gateup": (4096, 28672),
    "l3-down": (14336, 4096),
    "l3-lm_head": (4096, 128256),
}
DEFAULT_SHAPES = [s for s in SHAPES if not s.startswith("llama")]
QUICK_SHAPES = ("qwen-q/o", "qwen-k/v")
AFFINE_GROUP = 64
MODES = ("isolated", "chained", "independent")
SUBJECT = "vq-kernel"


def arm_bytes(in_features, out_features, bits, itemsize, m=1, prologue_blocks=(), core_blocks=(), core_stages=()):
    """Fewest bytes one call must move, per arm: weights as stored + activation in + output out."""
    io = m * (in_features + out_features) * itemsize
    packed = out_features * words_per_row(in_features, bits) * 4 + out_features * 4 + (4 << bits)
    affine = out_features * in_features // 2 + 2 * out_features * -(-in_features // AFFINE_GROUP) * itemsize
    return {
        "dense-fp16": out_features * in_features * 2 + m * (in_features + out_features) * 2,
        "dense-bf16": out_features * in_features * 2 + m * (in_features + out_features) * 2,
        "affine4": affine + io,
        "vq-ref": packed + io,
        "vq-kernel": packed + io,
        "vq-core": packed + io,
        **{f"vq-rot-{n}": packed + io for n in prologue_blocks},
        **{f"vq-core-{n}": packed + io for n in core_blocks},
        **{f"vq-core-st{n}": packed + io for n in core_stages},
    }


def _pool_size(args, packed_bytes):
    return int(min(args.max_pool, max(2, math.ceil((args.flush_mib << 20) / packed_bytes))))


def build(in_features, out_features, args):
    """Weight copies and activations for one shape; everything evaluated before timing."""
    dtype = getattr(mx, args.dtype)
    bits = args.bits
    n_pool = _pool_size(args, out_features * words_per_row(in_features, bits) * 4)
    rot = make_rotation("auto", in_features, seed=0)
    levels = mx.array((codebook(bits, in_features) / math.sqrt(in_features)).astype("float32"))
    keys = mx.random.split(mx.random.key(in_features * 7919 + out_features), 3 * n_pool + 1)
    pool = {"dense-fp16": [], "dense-bf16": [], "affine4": [], "vq": []}
    for j in range(n_pool):
        w = mx.random.normal((out_features, in_features), key=keys[3 * j]) * (1 / math.sqrt(in_features))
        w16, wb = w.astype(mx.float16), w.astype(mx.bfloat16)
        pool["dense-fp16"].append(w16)
        pool["dense-bf16"].append(wb)
        pool["affine4"].append(mx.quantize(w.astype(dtype), group_size=AFFINE_GROUP, bits=4))
        shape = (out_features, words_per_row(in_features, bits))
        packed = mx.random.randint(-(2**31), 2**31 - 1, shape, mx.int32, key=keys[3 * j + 1]).view(mx.uint32)
        scales = mx.random.uniform(0.5, 1.5, (out_features,), key=keys[3 * j + 2])
        pool["vq"].append(QuantizedLinear(in_features, out_features, bits, rot, packed, scales, levels))
        mx.eval(pool["dense-fp16"][-1], pool["dense-bf16"][-1], pool["affine4"][-1], pool["vq"][-1].parameters())
    xs = mx.random.normal((args.inputs, 1, args.m, in_features), key=keys[-1])
    xin = {"fp16": [xs[i].astype(mx.float16) for i in range(args.inputs)],
           "x": [xs[i].astype(dtype) for i in range(args.inputs)]}
    xin["xr"] = [rot.apply(x) for x in xin["x"]]
    mx.eval(xin)
    return pool, xin, n_pool


def make_arms(pool, xin, args, with_kernel):
    """{arm: f(w, x) -> y} and which activation pool each arm reads."""
    bits = args.bits

    def vq_ref(layer, x):
        with qmv.enabled(False):
            return layer(x)

    def vq_kernel(layer, x):
        with qmv.enabled(True):
            return layer(x)

    def vq_core(layer, xr):
        return qmv.quantized_matvec(xr, layer.packed, layer.scales, layer.codebook, bits, use_kernels=True)

    arms = {
        "dense-fp16": (lambda w, x: x @ w.T, "dense-fp16", "fp16"),
        "dense-bf16": (lambda w, x: x @ w.T, "dense-bf16", "x"),
        "affine4": (lambda w, x: mx.quantized_matmul(x, *w, transpose=True, group_size=AFFINE_GROUP, bits=4),
                    "affine4", "x"),
        "vq-ref": (vq_ref, "vq", "x"),
    }
    if args.dtype != "bfloat16":  # dense-bf16 then still runs at bf16: its activations are cast
        arms["dense-bf16"] = (lambda w, x: x.astype(mx.bfloat16) @ w.T, "dense-bf16", "x")
    if with_kernel:
        arms["vq-kernel"] = (vq_kernel, "vq", "x")
        arms["vq-core"] = (vq_core, "vq", "xr")
        for n in args.core_blocks:
            arms[f"vq-core-{n}"] = (_core_arm(n, bits), "vq", "xr")
        for n in args.core_stages:
            arms[f"vq-core-st{n}"] = (_stages_arm(n, bits), "vq", "xr")
        for n in args.prologue_blocks:
            arms[f"vq-rot-{n}"] = (_prologue_arm(n), "vq", "x")
    return arms


def _core_arm(max_blocks, bits):
    def vq_core(layer, xr):
        with qmv.block_limit(max_blocks):
            return qmv.quantized_matvec(xr, layer.packed, layer.scales, layer.codebook, bits, use_kernels=True)

    return vq_core


def _stages_arm(stages, bits):
    def vq_core(layer, xr):
        with qmv.ring_stages(stages):
            return qmv.quantized_matvec(xr, layer.packed, layer.scales, layer.codebook, bits, use_kernels=True)

    return vq_core


def _prologue_arm(max_blocks):
    def vq_rot(layer, x):
        with qmv.enabled(True), qmv.rotating_in_kernel(True, max_blocks):
            return layer(x)

    return vq_rot


def timed_fns(arms, pool, xin, mode, calls):
    """{arm: fn(i)} for ``run_interleaved``: ``calls`` calls per step (1 when isolated) on weight
    copies and activations rotating with the step index i."""
    n_pool, n_x = len(pool["vq"]), len(xin["x"])

    def make(fn, wkey, xkey):
        def step(i):
            outs, prev = [], None
            for j in range(calls):
                k = i * calls + j
                x = xin[xkey][k % n_x]
                if mode == "chained" and prev is not None:
                    # one elementwise add makes this call wait for the previous one (same for all arms)
                    x = x + prev[..., :1] * 0
                prev = fn(pool[wkey][k % n_pool], x)
                outs.append(prev)
            return outs[-1] if mode == "chained" else outs

        return step

    return {name: make(*spec) for name, spec in arms.items()}


def measure(name, in_features, out_features, args, copy_bps, with_kernel):
    pool, xin, n_pool = build(in_features, out_features, args)
    arms = make_arms(pool, xin, args, with_kernel)
    subject = SUBJECT if with_kernel else "vq-ref"
    dtype = getattr(mx, args.dtype)
    nbytes = arm_bytes(in_features, out_features, args.bits, dtype.size, args.m, args.prologue_blocks, args.core_blocks,
                       args.core_stages)
    check = None
    if with_kernel:  # kernel and dense path on the same input before anything is timed
        try:
            ref = arms["vq-ref"][0](pool["vq"][0], xin["x"][0]).astype(mx.float32)
            got = arms["vq-kernel"][0](pool["vq"][0], xin["x"][0]).astype(mx.float32)
            check = {"max_abs_diff_vs_ref": mx.max(mx.abs(got - ref)).item(), "max_abs_ref": mx.max(mx.abs(ref)).item()}
            for arm in (a for a in arms if a.startswith("vq-rot-")):
                rot = arms[arm][0](pool["vq"][0], xin["x"][0]).astype(mx.float32)
                check[f"{arm} max_abs_diff_vs_ref"] = mx.max(mx.abs(rot - ref)).item()
            core = arms["vq-core"][0](pool["vq"][0], xin["xr"][0])
            for arm in (a for a in arms if a.startswith("vq-core-")):  # the ring depth, the grid: same sums
                other = arms[arm][0](pool["vq"][0], xin["xr"][0])
                check[f"{arm} same bytes as vq-core"] = bool(mx.array_equal(other, core).item())
        except Exception as e:  # keep the other arms' figures; the error goes into the JSON
            check = {"kernel_error": repr(e)}
            print(f"bench-qmv: kernel failed on {name}: {e!r}", file=sys.stderr, flush=True)
            for arm in [a for a in arms if a.startswith(("vq-kernel", "vq-core", "vq-rot-"))]:
                arms.pop(arm)
            subject = "vq-ref"
    rows = []
    for mode in args.modes:
        calls = 1 if mode == "isolated" else args.calls
        fns = timed_fns(arms, pool, xin, mode, calls)
        fns[subject + harness.AA_SUFFIX] = fns[subject]
        times = harness.run_interleaved(fns, max(len(xin["x"]), n_pool), args.repeats, args.warmup)
        per_call = {arm: [t / calls for t in ts] for arm, ts in times.items()}
        floor = harness.noise_floor(times[subject], times[subject + harness.AA_SUFFIX])
        summ = {arm: harness.summarize(ts) for arm, ts in per_call.items()}
        gbps = {arm: nbytes[arm] / summ[arm]["median"] for arm in arms}
        row = {
            "shape": name, "in_features": in_features, "out_features": out_features, "M": args.m, "bits": args.bits,
            "dtype": args.dtype, "mode": mode, "calls_per_step": calls, "weight_copies": n_pool,
            "weight_pool_bytes": {arm: nbytes[arm] * n_pool for arm in arms},
            "bytes_per_call": {arm: nbytes[arm] for arm in arms},
            "arms": summ,
            "bytes_per_s": gbps,
            "fraction_of_copy_bandwidth": {arm: b / copy_bps for arm, b in gbps.items()} if copy_bps else None,
            "noise_floor": floor,
            "subject": subject,
            "comparisons": {
                f"{subject} vs {base}": harness.compare(per_call[base], per_call[subject], floor)
                for base in arms if base != subject
            },
        }
        if check:
            row["check"] = check
        rows.append(row)
    del pool, xin, arms
    mx.clear_cache()
    return rows


def _line(row):
    a, g = row["arms"], row["bytes_per_s"]
    parts = [f"{arm} {a[arm]['median'] * 1e6:.1f} us ({g[arm] / 1e9:.0f} GB/s)" for arm in g]
    ratios = [f"{c['speedup']:.2f}x vs {k.split(' vs ')[1]}" for k, c in row["comparisons"].items()]
    return (f"{row['shape']} {row['in_features']}->{row['out_features']} {row['mode']}: " + ", ".join(parts)
            + f" | {row['subject']}: " + ", ".join(ratios) + f" (floor {row['noise_floor']:.1%})")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.bench_qmv", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES), metavar="SHAPE",
                   help=f"layer shapes, of {', '.join(SHAPES)} (default: all but llama*)")
    p.add_argument("--m", type=int, default=1, choices=range(1, 9), metavar="M",
                   help="activation rows per call, 1..8 (default 1: decode)")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4), help="vqpipe bits (default 4)")
    p.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"),
                   help="activation dtype of the vq and affine arms (default bfloat16)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--calls", type=int, default=16, help="calls per step in the chained/independent modes")
    p.add_argument("--inputs", type=int, default=20, help="distinct activations in the rotating pool (>= 20)")
    p.add_argument("--flush-mib", type=int, default=256, help="weight copies per arm so one pass exceeds this")
    p.add_argument("--max-pool", type=int, default=256, help="at most this many weight copies")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--core-blocks", type=int, nargs="*", default=[], metavar="N",
                   help="add a vq-core-N arm per N: the kernel on a rotated input, <= N threadgroups")
    p.add_argument("--core-stages", type=int, nargs="*", default=[], choices=qmv.RING_CHOICES, metavar="N",
                   help="add a vq-core-stN arm per N: the kernel on a rotated input with an N-stage ring (0: registers)")
    p.add_argument("--prologue-blocks", type=int, nargs="*", default=[], metavar="N",
                   help="add a vq-rot-N arm per N: the rotation in the kernel's prologue, <= N threadgroups")
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer for the copy-bandwidth measurement")
    p.add_argument("--quick", action="store_true",
                   help="small CPU/CI run: shapes qwen-q/o and qwen-k/v, 2 weight copies, 5 repeats, 4 calls")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes = [s for s in args.shapes if s in QUICK_SHAPES] or list(QUICK_SHAPES)
        args.max_pool, args.repeats, args.warmup, args.calls, args.copy_mib = 2, 5, 1, 4, 64
    if args.inputs < 20:
        p.error("--inputs must be >= 20 (a rotating pool of distinct activations)")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with_kernel = qmv.kernels_active(None)
    skipped = {} if with_kernel else {
        arm: "no Metal/CUDA backend on the default device (or VQPIPE_QMV_KERNELS=0): the fused kernel cannot run"
        for arm in ("vq-kernel", "vq-core")
    }
    copy = roofline.measure_copy_bandwidth(args.copy_mib << 20, repeats=max(args.repeats // 4, 3), warmup=2)
    rows = []
    for name in args.shapes:
        in_features, out_features = SHAPES[name]
        for row in measure(name, in_features, out_features, args, copy["median"], with_kernel):
            print(_line(row), flush=True)
            rows.append(row)
    result = {
        "kind": "bench-qmv",
        "environment": env.environment_or_error(),
        "backend": qmv.backend() if with_kernel else None,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "copy_bandwidth": copy,
        "harness_overhead_s": harness.empty_call_overhead(args.repeats, args.warmup),
        "skipped_arms": skipped,
        "compiled_kernels": qmv.compiled_kernel_count(),
        "results": rows,
    }
    write_json(args.out, result)
    print(f"bench-qmv: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
