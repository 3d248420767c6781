"""The qmv kernel's GPU time per launch, outside MLX, against the copy and a plain read of the same bytes.

bench-qmv times layer calls through MLX, where a custom-kernel call costs ~25 us of host time and,
for arms whose 16 calls fit one CUDA graph (MLX commits a graph every 100 ops or 1000 MB on an H100
or H200), that host time is not overlapped with the GPU's work. This measures the kernel itself:
the source ``qmv.render("cuda")`` gives MLX, compiled by NVRTC with MLX's options and wrapper
(experiments/cuda_time.py), launched back to back on a rotating pool of weight copies (> 512 MiB
per pass, so they stream from HBM, not the 50 MB L2) and >= 20 activations, timed between CUDA
events; GB/s counts the bytes a launch must move (packed words, scales, x, y).

Arms per shape, interleaved (A B C ... A B C ...), with an A/A copy of the first:

- ``copy``: cuMemcpyDtoD of ``--copy-mib`` (1 GiB; bytes read + written, as bench-qmv's copy figure);
- ``read``: a plain 16-byte-load read of the same packed bytes (what streaming them can cost);
- one arm per kernel variant ``MODULE:RING:BLOCKS:LUT:ABLATIONS:ROWS`` (``qmv`` the current one, ``qmv_v6`` a
  saved earlier revision; RING ``auto`` = qmv's choice by M, 0 = registers, 2..4 ring stages; BLOCKS 0 =
  the default cap; LUT ``auto``, 0 = revision 6's lookups, 1 = revision 7's pair tables; ABLATIONS a
  ``+``-joined subset of ``ABLATIONS``, kernels that skip a part of the work so the time they save says
  what that part costs; ROWS ``auto``, 2 or 4 output rows per warp), each checked against a float64 evaluation of the formula on 512 rows first
  (an ablation's check is expected to fail: it computes something else);
- revision 8, the tensor-core kernel (vqpipe/kernels/qmv_tc.py): ``qmv_tc:BLOCKS:TARGET:MINBLOCKS:PF:ABLATIONS`` (0 or
  empty = its default: grid cap, warps wanted before K is split, a __launch_bounds__ minimum, codes in flight,
  ``tcnolut``/``tcnoload``); its check runs on copy 0 repacked, its timed launches read the pool's random words
  as they are (any permutation of random words is as random).

    python -m experiments.qmv_gpu_time --out FILE.json [--variants qmv:0:0 qmv:4:0 qmv_v6 qmv:auto:0:1:nolut]

``--check-only`` compiles and checks (one launch per variant and case) without timing: the run to
put under a profiler (``ncu --kernel-name regex:vqpipe_qmv ... python -m experiments.qmv_gpu_time
--check-only``).
"""

import argparse
import ctypes
import importlib
import json
import math
import statistics
import sys
import time

import numpy as np

from experiments import cuda_time as ct

SHAPES = {"l3-qkv": (4096, 6144), "l3-gateup": (4096, 28672), "l3-down": (14336, 4096), "l3-lm_head": (4096, 128256),
          "qwen-gateup": (896, 9728), "qwen-lm_head": (896, 151936), "l3-o": (4096, 4096), "qwen-qkv": (896, 1152),
          "qwen-down": (4864, 896)}
READ_SRC = r"""
extern "C" __global__ void stream_read(const uint4* p, unsigned long long n, unsigned int* out) {
    unsigned int acc = 0u;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {  // 4 loads in flight per thread
        const uint4 a = p[i], b = p[i + step], c = p[i + 2 * step], d = p[i + 3 * step];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += step) { const uint4 a = p[i]; acc ^= a.x ^ a.y ^ a.z ^ a.w; }
    if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads; practically never true
}
extern "C" __global__ void spin(long long cycles) {  // keeps the GPU busy while the host enqueues
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""
POOL_BYTES = 1 << 30
# Ablations: (text of the rendered source, its replacement). nolut: the codebook value comes from the code
# itself (its bits OR'd into 1.0f: one ALU op, no shared-memory lookup), for revision 6's per-value and
# revision 7's pair lookups; noload: the packed words are made from their offset (integer multiplies)
# instead of being loaded (16-byte path), so nothing streams from HBM but the activation.
ABLATIONS = {
    "nolut": [
        ("return *reinterpret_cast<const float2*>(reinterpret_cast<const unsigned char*>(t) + "
         "qmv_pair_off<BITS, PLS>(w, p, lcp));",
         "const unsigned int o_ = qmv_pair_off<BITS, PLS>(w, p, lcp); "
         "return make_float2(__uint_as_float((o_ >> 7) | 0x3f800000u), __uint_as_float((o_ << 9) | 0x3f800000u));"),
        ("const float w = cb_s[qmv_index<BITS, PER>(win[r], h * SC + t)];",
         "const float w = __uint_as_float((qmv_index<BITS, PER>(win[r], h * SC + t) << 19) | 0x3f800000u);"),
    ],
    # not an ablation, a candidate: the packed words' 16-byte loads as ld.global.cs (evict first), so the
    # streamed words do not push the activation (read by every warp) out of L1
    "ldcs": [
        ("const uint4 v = *reinterpret_cast<const uint4*>(p + off);",
         "const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p + off));"),
    ],
    # revision 8 (qmv_tc): tcnolut, the pair lookup replaced by two ALU ops on its address (no shared-memory
    # load); tcnoload, the codes made from their address instead of loaded (nothing streams but x)
    "tcnolut": [
        ('asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(e.x), "=r"(e.y) : "r"(a));',
         "e.x = a * 2654435761u; e.y = a ^ 0x3f803f80u;"),
    ],
    "tcnoload": [
        ("q0[PF - 1] = p[0]; q1[PF - 1] = p[32];",
         "{ const unsigned int o_ = (unsigned int)(size_t)p; q0[PF - 1] = make_uint4(o_ * 2654435761u, o_ * 2246822519u, "
         "o_ * 3266489917u, o_ * 668265263u); q1[PF - 1] = make_uint4(o_ ^ 1u, o_ ^ 2u, o_ ^ 3u, o_ ^ 4u); }"),
    ],
    "noload": [
        ("const uint4 v = *reinterpret_cast<const uint4*>(p + off);",
         "const uint4 v = make_uint4(off * 2654435761u, (off + 1u) * 2246822519u, (off + 2u) * 3266489917u, "
         "(off + 3u) * 668265263u);"),
    ],
}


def ablate(header, body, names):
    """(header, body) with the ablations ``names`` applied; each must change the source."""
    for name in names:
        if name not in ABLATIONS:
            raise ValueError(f"qmv_gpu_time: unknown ablation {name!r} (known: {', '.join(ABLATIONS)})")
        hit = False
        for old, new in ABLATIONS[name]:
            hit |= old in header or old in body
            header, body = header.replace(old, new), body.replace(old, new)
        if not hit:
            raise ValueError(f"qmv_gpu_time: ablation {name!r} matches nothing in this kernel's source")
    return header, body


def _dtype_name(v):
    return str(v).split(".")[-1] if not isinstance(v, int) else v


def bf16_bits(a):
    """float32 array -> bfloat16 bit patterns (round to nearest even), uint16."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def unpack_rows(words, bits, n_in):
    """Codes of packed rows (uint32 [rows, words]) as int [rows, n_in] (LSB-first stream)."""
    b = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, : n_in * bits]
    return (b.reshape(len(words), n_in, bits) * (1 << np.arange(bits))).sum(-1)


class Variant:
    def __init__(self, text, drv, cache):
        parts = text.split(":")
        self.tc = parts[0] == "qmv_tc"
        if self.tc:  # qmv_tc[:BLOCKS[:TARGET_WARPS[:MINBLOCKS[:PREFETCH[:ABLATIONS]]]]]: revision 8 (tensor cores)
            blocks, target, minb, pf, abl = (parts[1:] + ["0", "0", "0", "0", ""][len(parts) - 1:])[:5]
            self.pf = int(pf) or None
            self.name, self.mod, self.drv, self.cache = text, importlib.import_module("vqpipe.kernels.qmv_tc"), drv, cache
            self.blocks, self.target, self.minb = int(blocks) or None, int(target) or None, int(minb)
            self.ablations = tuple(a for a in abl.split("+") if a)
            return
        mod, stages, blocks, lut, abl, rows = parts + ["auto", "0", "auto", "", "auto"][len(parts) - 1:]
        self.name, self.mod = text, importlib.import_module(f"vqpipe.kernels.{mod}")
        self.stages = None if stages in ("", "auto") else int(stages)
        self.lut = None if lut in ("", "auto") else int(lut)
        self.rows = None if rows in ("", "auto") else int(rows)
        self.ablations = tuple(a for a in abl.split("+") if a)
        self.blocks, self.drv, self.cache = int(blocks) or None, drv, cache

    def spec(self, x_shape, p_shape, s_shape, bits, mx):
        if self.tc:
            if bits != 4:
                raise ValueError("qmv_tc takes 4 bits only")
            return self.mod.launch_spec(tuple(x_shape), p_shape[0], tuple(s_shape), None, mx.bfloat16,
                                        max_blocks=self.blocks, target=self.target, prefetch=self.pf)
        kw = {"max_blocks": self.blocks}
        if self.stages is not None:
            kw["stages"] = self.stages
        if self.lut is not None:
            kw["lut"] = self.lut
        if self.rows is not None:
            kw["rows"] = self.rows
        return self.mod.launch_spec(x_shape, p_shape, s_shape, 1 << bits, None, bits, mx.bfloat16, **kw)

    def function(self, spec):
        if self.tc:
            name, header, body = self.mod.render(1, self.minb)
        else:
            name, header, body = self.mod.render("cuda", 1)
        header, body = ablate(header, body, self.ablations)
        tmpl = [(k, _dtype_name(v)) for k, v in spec["template"]]
        key = (name, tuple(tmpl), self.ablations)
        if key not in self.cache:
            inputs = TC_INPUTS if self.tc else QMV_INPUTS
            src = ct.kernel_source(name, header, body, inputs, [("out0", "bfloat16")], tmpl)
            t0 = time.perf_counter()
            cubin, _ = ct.compile_cubin(src)
            fn, regs = self.drv.load(cubin, name)
            self.cache[key] = (fn, regs, time.perf_counter() - t0, src)
        return self.cache[key]


QMV_INPUTS = [("x", "bfloat16", 3), ("packed", "uint32", 2), ("scales", "float32", 1), ("codebook", "float32", 1),
              ("bias", "bfloat16", 2), ("rot_s", "float32", 2), ("rot_l", "float32", 2), ("seg", "int32", 1)]
TC_INPUTS = [("x", "bfloat16", 3), ("packed", "uint32", 1), ("scales", "float32", 1), ("codebook", "float32", 1),
             ("bias", "bfloat16", 2), ("seg", "int32", 1)]


def tc_args(body, bufs, x_shape, p_shape, s_shape):
    """qmv_tc's parameters in MLX's order (the same rule as :func:`kernel_args`, for TC_INPUTS)."""
    u64, i32 = ctypes.c_uint64, ctypes.c_int32
    shapes = {"x": x_shape, "packed": (p_shape[0] * p_shape[1],), "scales": s_shape, "codebook": (16,), "bias": (1, 1),
              "seg": (1,)}
    args = []
    for name, _, _ in TC_INPUTS:
        args.append(u64(bufs[name]))
        if f"{name}_shape" in body:
            args.append(ct.shape_arg(shapes[name]))
        if f"{name}_ndim" in body:
            args.append(i32(len(shapes[name])))
    return args + [u64(bufs["out"])]


def kernel_args(body, bufs, x_shape, p_shape, s_shape):
    """ctypes values in MLX's parameter order (pointer, then shape/ndim where the body uses them)."""
    if "qtc_mma" in body:
        return tc_args(body, bufs, x_shape, p_shape, s_shape)
    u64, i32 = ctypes.c_uint64, ctypes.c_int32
    args = [u64(bufs["x"]), ct.shape_arg(x_shape), i32(len(x_shape)),
            u64(bufs["packed"]), ct.shape_arg(p_shape)]
    args += [u64(bufs["scales"])] + ([ct.shape_arg(s_shape)] if "scales_shape" in body else [])
    args += [u64(bufs["codebook"]), u64(bufs["bias"])] + ([i32(2)] if "bias_ndim" in body else [])
    args += [u64(bufs["rot_s"]), u64(bufs["rot_l"])] + ([ct.shape_arg((1, 1))] if "rot_l_shape" in body else [])
    args += [u64(bufs["seg"]), u64(bufs["out"])]
    return args


def check(drv, fn, spec, body, bufs, x_shape, p_shape, s_shape, host, bits, rows):
    """Max error over ``rows`` against float64, in units of the bound (float32 accumulation + half a
    bf16 ulp); < 1 passes."""
    n_out, wpr = p_shape
    n_in = x_shape[-1]
    m = math.prod(x_shape[:-1])
    drv.launch(fn, (spec["grid"][0] // 32, spec["grid"][1] // spec["threadgroup"][1], spec["grid"][2] // spec["threadgroup"][2]),
               spec["threadgroup"], kernel_args(body, bufs, x_shape, p_shape, s_shape))
    drv.sync()
    y = bf16_value(drv.download(bufs["out"], np.zeros(m * n_out, np.uint16)).reshape(m, n_out))[:, rows]
    w = host["levels"].astype(np.float64)[unpack_rows(host["packed"][rows], bits, n_in)]
    x = bf16_value(host["x"]).astype(np.float64).reshape(m, n_in)
    s = host["scales"][rows].astype(np.float64)
    ref = (x @ w.T) * s
    bound = (n_in / 4 + 64) * 2.0**-24 * ((np.abs(x) @ np.abs(w).T) * s) + 2.0**-8 * np.abs(ref)
    return float(np.max(np.abs(y - ref) / bound))


def time_arms(drv, arms, repeats, warmup, busy):
    """{arm: [seconds per launch]} interleaved; arms: {name: (run(i) enqueueing `calls` launches, calls)}."""
    out = {k: [] for k in arms}
    for r in range(warmup + repeats):
        for name, (run, calls) in arms.items():
            t = drv.elapsed(lambda: run(r), busy)
            if r >= warmup:
                out[name].append(t / calls)
    return out


def summary(ts):
    return {"n": len(ts), "median": statistics.median(ts), "min": min(ts), "max": max(ts)}


def measure_shape(drv, name, n_in, n_out, bits, m, variants, pool, args, read_fn, busy):
    import mlx.core as mx  # only for the Dtype objects launch_spec takes (no device work)

    wpr = -(-n_in * bits // 32)
    p_shape, x_shape, s_shape = (n_out, wpr), (1, m, n_in), (n_out,)
    pbytes = n_out * wpr * 4
    span = -(-pbytes // 256) * 256
    copies = max(2, min(args.max_pool, POOL_BYTES // span))
    rng = np.random.default_rng(n_in * 31 + n_out + bits)
    host = {"scales": rng.uniform(0.5, 1.5, n_out).astype(np.float32),
            "levels": np.sort(rng.standard_normal(1 << bits)).astype(np.float32) / np.float32(math.sqrt(n_in)),
            "packed": np.zeros((0, wpr), np.uint32)}
    xs = [bf16_bits(rng.standard_normal(m * n_in).astype(np.float32)) for _ in range(args.inputs)]
    host["x"] = xs[0]
    bufs = {"scales": drv.upload(host["scales"]), "codebook": drv.upload(host["levels"]),
            "bias": drv.upload(np.zeros(1, np.uint16)), "rot_s": drv.upload(np.zeros(1, np.float32)),
            "rot_l": drv.upload(np.zeros(1, np.float32)), "seg": drv.upload(np.zeros(1, np.int32)),
            "out": drv.alloc(m * n_out * 2)}
    xbufs = [drv.upload(x) for x in xs]
    rows = np.unique(np.linspace(0, n_out - 1, 512).astype(int))
    host["packed"] = np.zeros((n_out, wpr), np.uint32)
    drv.download(pool, host["packed"])  # copy 0 = the pool's first bytes
    copy_ptr = [pool + k * span for k in range(copies)]
    nbytes = pbytes + n_out * 4 + 2 * m * (n_in + n_out)
    arms, info = {}, {}
    for v in variants:
        spec = v.spec(x_shape, p_shape, s_shape, bits, mx)
        fn, regs, secs, src = v.function(spec)
        body = src
        bufs.update(x=xbufs[0], packed=copy_ptr[0])
        if v.tc:  # the check needs copy 0 in the kernel's order; the timed copies are random words either way
            if "tc_packed" not in bufs:
                bufs["tc_packed"] = drv.upload(np.ascontiguousarray(v.mod.repack(host["packed"])))
            bufs["packed"] = bufs["tc_packed"]
        err = check(drv, fn, spec, body, bufs, x_shape, p_shape, s_shape, host, bits, rows)
        grid = (spec["grid"][0] // 32, 1, 1)
        block = spec["threadgroup"]
        bufs["packed"] = copy_ptr[0]
        launches = [drv.params(kernel_args(body, dict(bufs, x=xbufs[k % len(xbufs)], packed=copy_ptr[k % copies]),
                                           x_shape, p_shape, s_shape)) for k in range(max(copies, len(xbufs)) * 2)]

        def run(r, fn=fn, grid=grid, block=block, launches=launches):
            for j in range(args.calls):
                drv.launch(fn, grid, block, launches[(r * args.calls + j) % len(launches)])

        arms[v.name] = (run, args.calls)
        info[v.name] = {"grid": list(spec["grid"]), "threadgroup": list(block), "registers": regs,
                        "template": [[k, str(t)] for k, t in spec["template"]], "compile_s": secs,
                        "max_error_in_bounds": err, "check_rows": len(rows)}
        print(f"  {v.name}: grid {grid[0]} x {block}, {regs} regs, error {err:.3f} of the bound", flush=True)
    if args.check_only:
        return {"shape": name, "bits": bits, "M": m, "variants": info}
    first = variants[0].name
    arms[first + " (A/A)"] = arms[first]
    out = ctypes.c_uint64(drv.alloc(16))
    n16 = ctypes.c_uint64(pbytes // 16)
    rargs = [drv.params([ctypes.c_uint64(copy_ptr[k]), n16, out]) for k in range(copies)]

    def read(r):
        for j in range(args.calls):
            drv.launch(read_fn, (drv.sms * 8, 1, 1), (256, 1, 1), rargs[(r * args.calls + j) % copies])

    arms["read"] = (read, args.calls)
    times = time_arms(drv, arms, args.repeats, args.warmup, busy)
    res = {a: summary(ts) for a, ts in times.items()}
    a, b = times[first], times[first + " (A/A)"]
    floor = abs(statistics.median(a) / statistics.median(b) - 1)
    gbps = {k: (pbytes if k == "read" else nbytes) / s["median"] for k, s in res.items()}
    for k in {*bufs.values(), *xbufs} - set(copy_ptr):
        drv.free(k)
    return {"shape": name, "in_features": n_in, "out_features": n_out, "bits": bits, "M": m, "copies": copies,
            "bytes_per_launch": nbytes, "read_bytes": pbytes, "arms": res, "bytes_per_s": gbps, "aa_floor": floor,
            "variants": info}


def copy_bandwidth(drv, buf, nbytes, repeats):
    """cuMemcpyDtoD of ``nbytes`` from buf to buf + nbytes (2 * nbytes allocated), read + written bytes per s."""
    ts = []
    for r in range(repeats + 2):
        t = drv.elapsed(lambda: drv.copy(buf + nbytes, buf, nbytes))
        if r >= 2:
            ts.append(2 * nbytes / t)
    return summary(ts)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.qmv_gpu_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", nargs="+", default=["qmv:auto:0", "qmv:0:0", "qmv:4:0"])
    p.add_argument("--cases", nargs="+", default=["l3-qkv:4:1", "l3-gateup:4:1", "l3-down:4:1", "l3-lm_head:4:1"],
                   help="SHAPE:BITS:M")
    p.add_argument("--calls", type=int, default=24, help="launches per timed sample")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inputs", type=int, default=20)
    p.add_argument("--max-pool", type=int, default=64)
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes each copy sample copies (read + written: 2x)")
    p.add_argument("--check-only", action="store_true", help="compile and check each variant once, no timing")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    drv = ct.Driver()
    pool = drv.alloc(POOL_BYTES)
    rng = np.random.default_rng(0)
    chunk = 1 << 26
    for off in range(0, POOL_BYTES, chunk):  # random packed words: every code value occurs
        data = rng.integers(0, 2**32, chunk // 4, dtype=np.uint32)
        ct._ok(drv.cu.cuMemcpyHtoD_v2(pool + off, data.ctypes.data, chunk), "cuMemcpyHtoD")
    read_cubin, _ = ct.compile_cubin(ct.PRELUDE + READ_SRC)
    read_fn, _ = drv.load(read_cubin, "stream_read")
    spin_fn, _ = drv.load(read_cubin, "spin")
    spin_args = drv.params([ctypes.c_longlong(2_000_000)])  # ~1 ms at the H200's clock

    def busy():
        drv.launch(spin_fn, (1, 1, 1), (1, 1, 1), spin_args)

    cache = {}
    variants = [Variant(v, drv, cache) for v in args.variants]
    copy_bytes = args.copy_mib << 20
    copy_buf = drv.alloc(2 * copy_bytes)
    copy = copy_bandwidth(drv, copy_buf, copy_bytes, 2 if args.check_only else 10)
    print(f"{drv.name}, {drv.sms} SMs; copy {copy['median'] / 1e9:.0f} GB/s [{copy['min'] / 1e9:.0f}-"
          f"{copy['max'] / 1e9:.0f}] (read + write, {args.copy_mib} MiB)", flush=True)
    results = []
    for case in args.cases:
        name, bits, m = case.split(":")
        n_in, n_out = SHAPES[name]
        print(f"== {name} {n_in}->{n_out} {bits}-bit M={m}", flush=True)
        row = measure_shape(drv, name, n_in, n_out, int(bits), int(m), variants, pool, args, read_fn, busy)
        if args.check_only:
            results.append(row)
            continue
        copy_now = copy_bandwidth(drv, copy_buf, copy_bytes, 5)
        row["copy_after"] = copy_now
        for k, s in row["arms"].items():
            g = row["bytes_per_s"][k]
            print(f"  {k:>22}: {s['median'] * 1e6:8.1f} us [{s['min'] * 1e6:.1f}-{s['max'] * 1e6:.1f}] n={s['n']}  "
                  f"{g / 1e9:6.0f} GB/s  {g / copy['median']:5.1%} of copy", flush=True)
        print(f"  A/A floor {row['aa_floor']:.1%}", flush=True)
        results.append(row)
    doc = {"kind": "qmv-gpu-time", "device": drv.name, "sms": drv.sms, "copy_bandwidth": copy,
           "config": vars(args), "results": results}
    with open(args.out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    import os

    os.replace(args.out + ".tmp", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
