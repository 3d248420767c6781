"""Fused "prep" kernels: a rotated mat-vec's input in one launch (decode, M <= 8 rows).

In decode_step's split mode a layer's four rotated mat-vecs read inputs that MLX ops make in two or
three primitives each (docs/decode.md, "The fusions, counted"):

- q|k|v and gate|up: ``rms_norm(h, w)``, then the Hadamard transform (the rotation's signs are in
  ``w`` already: vqpipe/fold.py);
- o_proj: the attention output times its rotation's signs, then the transform;
- down_proj: ``silu(gate) * up``, then the transform (signs folded into up's rows).

On the split step's host every primitive costs ~7-11 us to encode (docs/decode.md), so each of
these becomes one launch here: 19 -> 15 primitives per layer (13 with the residual epilogue).
The work is the ops' own, done once per row (G threadgroups split only L's output rows), not redone
by every mat-vec threadgroup as revision 6's prologue rotation was. Measured on the H200 (docs/decode.md,
"Prep kernels"): no measurable difference in decode speed; a custom-kernel launch costs the host
about as much as three or four built-in primitives at MLX 0.32.4, so the switch stays off.

The rotation is the one vqpipe/qmv.py's prologue uses, R = (L (x) S_B / sqrt(B)) diag(sd) for a
row viewed as A x B (``qmv.rotation_operands``: L is MLX's normalised Hadamard base matrix, the
Kronecker factor Q, or [1]; S_B Sylvester), so y = R f(x) equals ``rotation.apply(f(x))``
(mx.hadamard_transform's semantics and scaling) up to float32 rounding. Everything is computed in
float32 and cast once to x's dtype: the unfused ops round to bf16 after the norm / SwiGLU too, so
in bf16 the results differ by those roundings; in float32 by the order of the sums only.

Kernel layout (one row, ``NT`` threads, ``KB`` values of b per thread and a): thread t holds
element a * B + k * NT + t for every a < A, k < KB, in registers. The Sylvester transform is one
butterfly per bit of b: the k bits in registers, the 5 lane bits by shuffles, the warp bits
through shared memory (slices of NT floats, ``EXCH`` floats at a time); then each thread applies L
to its own column (A x A multiply-adds, split over G threadgroups by output rows a), scales by
1 / sqrt(B) and stores. CUDA through ``mx.fast.cuda_kernel``; the Metal dialect is written from the
same description and is untested (no Apple GPU was available).
"""

import hashlib
import math
import os
import re

import mlx.core as mx
import numpy as np

from . import qmv

OPS = {"rotate": 0, "norm": 1, "swiglu": 2}
MAX_M = qmv.MAX_M
MIN_B = 32  # a row's power-of-two factor at least one warp wide
MAX_NT = 512  # threads per threadgroup
MAX_REGS = 64  # A * KB values held per thread
L_MACS = 224  # per thread at most A * ceil(A / G) multiply-adds of L: G threadgroups per row above that
EXCH = {"cuda": 8192, "metal": 4096}  # floats of shared memory for the warp-bit exchange

# Decoder(prep=None) follows this: VQPIPE_QMV_PREP=1 turns the fused prep kernels on in split mode.
# Off by default until measured on the H200 (docs/decode.md).
PREP = os.environ.get("VQPIPE_QMV_PREP", "0") == "1"

_SOURCE = """
    constexpr int NS = NA * KB;                          // values per thread: slice s = a * KB + k
    constexpr int B = NT * KB;                           // the power-of-two factor of the row
    constexpr int NAO = (NA + G - 1) / G;                // output rows a of L per threadgroup
    constexpr int SL = PREP_EXCH / NT;                   // slices per exchange round (>= 1)
    QMV_SHARED float red_s[32];
    QMV_SHARED float ex_s[PREP_EXCH];
    const unsigned int t = PREP_TID;
    const unsigned int lane = t & 31u, warp = t >> 5;
    const unsigned int row = PREP_ROW;                   // activation row m
    const unsigned int g = PREP_GROUP;                   // which output rows of L this threadgroup writes
    const unsigned int D = NA * B;
    const unsigned int base = row * D;
    float v[NS];
    QMV_UNROLL
    for (int s = 0; s < NS; ++s) {
        const unsigned int i = (unsigned int)(s / KB) * B + (unsigned int)(s % KB) * NT + t;
        float a = static_cast<float>(x[base + i]);
        if (OP == 2) {                                   // silu(gate) * up
            a = a / (1.0f + prep_exp(-a)) * static_cast<float>(x2[base + i]);
        }
        v[s] = a;
    }
    if (OP == 1) {                                       // rms_norm: the sum of squares, fixed order
        float ss = 0.0f;
        QMV_UNROLL
        for (int s = 0; s < NS; ++s) {
            ss += v[s] * v[s];
        }
        QMV_UNROLL
        for (int h = 16; h > 0; h /= 2) {
            ss += qmv_shfl_xor(ss, h);
        }
        if (lane == 0u) {
            red_s[warp] = ss;
        }
        QMV_BARRIER;
        ss = 0.0f;
        for (unsigned int wi = 0; wi < NT / 32u; ++wi) {
            ss += red_s[wi];
        }
        const float r = 1.0f / prep_sqrt(ss / (float)D + eps[0]);
        QMV_UNROLL
        for (int s = 0; s < NS; ++s) {
            const unsigned int i = (unsigned int)(s / KB) * B + (unsigned int)(s % KB) * NT + t;
            v[s] = v[s] * r * static_cast<float>(w[i]);
        }
    }
    QMV_UNROLL
    for (int s = 0; s < NS; ++s) {
        v[s] *= sd[(unsigned int)(s / KB) * B + (unsigned int)(s % KB) * NT + t];
    }
    // S_B, one butterfly per bit of b = k * NT + t: the k bits in registers
    QMV_UNROLL
    for (int h = 1; h < KB; h *= 2) {
        QMV_UNROLL
        for (int s = 0; s < NS; ++s) {
            if ((s % KB) & h) {
                continue;
            }
            const float p = v[s], q = v[s + h];
            v[s] = p + q;
            v[s + h] = p - q;
        }
    }
    // the lane bits: the partner's value by shuffle (the lower index keeps p + q)
    QMV_UNROLL
    for (int h = 1; h < 32; h *= 2) {
        const bool hi = (lane & (unsigned int)h) != 0u;
        QMV_UNROLL
        for (int s = 0; s < NS; ++s) {
            const float p = qmv_shfl_xor(v[s], h);
            v[s] = hi ? p - v[s] : v[s] + p;
        }
    }
    // the warp bits: the partner's value through shared memory, SL slices a round
    QMV_UNROLL
    for (int s0 = 0; s0 < NS; s0 += SL) {
        QMV_UNROLL
        for (int h = 32; h < NT; h *= 2) {
            const bool hi = (t & (unsigned int)h) != 0u;
            QMV_UNROLL
            for (int s = s0; s < NS && s < s0 + SL; ++s) {
                ex_s[(s - s0) * NT + t] = v[s];
            }
            QMV_BARRIER;
            QMV_UNROLL
            for (int s = s0; s < NS && s < s0 + SL; ++s) {
                const float p = ex_s[(s - s0) * NT + (t ^ (unsigned int)h)];
                v[s] = hi ? p - v[s] : v[s] + p;
            }
            QMV_BARRIER;
        }
    }
    // L over a, for this threadgroup's output rows, then the scale and one cast
    const float scl = 1.0f / prep_sqrt((float)B);
    QMV_UNROLL
    for (int ao = 0; ao < NAO; ++ao) {
        const unsigned int a = g * NAO + ao;
        if (a >= NA) {
            break;
        }
        QMV_UNROLL
        for (int k = 0; k < KB; ++k) {
            float y = v[k];
            if (NA > 1) {
                y = 0.0f;
                QMV_UNROLL
                for (int a2 = 0; a2 < NA; ++a2) {
                    y += L[a * NA + a2] * v[a2 * KB + k];
                }
            }
            out[base + a * B + (unsigned int)k * NT + t] = static_cast<T>(y * scl);
        }
    }
"""

_CUDA_HEADER = """
__device__ __forceinline__ float qmv_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ float prep_exp(float v) { return expf(v); }
__device__ __forceinline__ float prep_sqrt(float v) { return sqrtf(v); }
"""

# Untested: no Apple GPU was available.
_METAL_HEADER = """
inline float qmv_shfl_xor(float v, int m) { return metal::simd_shuffle_xor(v, ushort(m)); }
inline float prep_exp(float v) { return metal::precise::exp(v); }
inline float prep_sqrt(float v) { return metal::precise::sqrt(v); }
"""

DIALECTS = {
    "cuda": {"header": _CUDA_HEADER, "tokens": {
        "QMV_SHARED": "__shared__", "QMV_BARRIER": "__syncthreads()", "QMV_UNROLL": "#pragma unroll",
        "PREP_TID": "threadIdx.x", "PREP_ROW": "blockIdx.y", "PREP_GROUP": "blockIdx.x", "PREP_EXCH": str(EXCH["cuda"])}},
    "metal": {"header": _METAL_HEADER, "tokens": {
        "QMV_SHARED": "threadgroup", "QMV_BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
        "QMV_UNROLL": "#pragma unroll", "PREP_TID": "thread_position_in_threadgroup.x",
        "PREP_ROW": "threadgroup_position_in_grid.y", "PREP_GROUP": "threadgroup_position_in_grid.x",
        "PREP_EXCH": str(EXCH["metal"])}},
}
INPUT_NAMES = ["x", "x2", "w", "eps", "sd", "L"]
_kernels = {}
_placeholders = {}
_eps = {}


def render(dialect):
    """(name, header, body), minified as vqpipe/qmv.py's (MLX hashes the source per call); the name
    carries a digest of the source (MLX caches compiled kernels by name)."""
    spec = DIALECTS[dialect]
    body = _SOURCE
    for token, text in spec["tokens"].items():
        body = re.sub(rf"\b{token}\b", text, body)
    header, body = qmv.minify(spec["header"]), qmv.minify(body)
    return f"vqpipe_prep_{hashlib.sha1((header + body).encode()).hexdigest()[:10]}", header, body


def _kernel(dialect):
    if dialect not in _kernels:
        name, header, body = render(dialect)
        make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
        _kernels[dialect] = make(name=name, input_names=INPUT_NAMES, output_names=["out"], source=body, header=header)
    return _kernels[dialect]


def layout(dim, a, dialect="cuda"):
    """(NT, KB, G) for a row of ``dim`` = a * B, or None where the kernel does not take it (B not a
    power of two >= MIN_B, more than MAX_REGS values per thread)."""
    b = dim // a
    if a * b != dim or b < MIN_B or b & (b - 1):
        return None
    nt = min(b, MAX_NT)
    kb = b // nt
    if a * kb > MAX_REGS or EXCH[dialect] < nt:
        return None
    g = 1
    while a * -(-a // g) > L_MACS:
        g += 1
    return nt, kb, -(-a // -(-a // g))  # no threadgroup left without rows


def plan(rotation, x, dialect):
    """The launch's (sd, L, NT, KB, G) for ``rotation`` on ``x``, or None: then the MLX ops run."""
    if dialect is None or x.dtype not in qmv.DTYPES or not 0 < qmv.rows_of(x) <= MAX_M:
        return None
    key = ("prep", dialect)
    if key not in rotation._cast:
        ops = qmv.rotation_operands(rotation)
        lay = None if ops is None else layout(rotation.dim, ops[1].shape[0], dialect)
        rotation._cast[key] = None if lay is None else (*ops, *lay)
    found = rotation._cast[key]
    return found if found is not None and x.shape[-1] == rotation.dim else None


def _placeholder(dtype):
    if dtype not in _placeholders:
        _placeholders[dtype] = mx.zeros((1,), dtype)
        mx.eval(_placeholders[dtype])  # not a Full primitive in every compiled step (qmv._placeholder)
    return _placeholders[dtype]


def _eps_array(eps):
    if eps not in _eps:
        _eps[eps] = mx.array([eps], mx.float32)
    return _eps[eps]


def launch(dialect, op, x, found, x2=None, w=None, eps=0.0):
    """One prep launch: R f(x) in x's dtype, with ``found`` = :func:`plan`'s tuple."""
    sd, lmat, nt, kb, g = found
    a = lmat.shape[0]
    wt = x.dtype if w is None else w.dtype
    return _kernel(dialect)(
        inputs=[x, x if x2 is None else x2, _placeholder(x.dtype) if w is None else w, _eps_array(float(eps)), sd, lmat],
        template=[("T", x.dtype), ("WT", wt), ("OP", OPS[op]), ("NA", a), ("KB", kb), ("NT", nt), ("G", g)],
        grid=(nt * g, qmv.rows_of(x), 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )[0]


# --- what the split step calls: the kernel where it applies, else the unfused MLX ops -------------

def rotate(x, rotation):
    """``rotation.apply(x)`` (o_proj's input: signs, then the transform)."""
    found = plan(rotation, x, qmv.dispatch(x))
    return rotation.apply(x) if found is None else launch(qmv.dispatch(x), "rotate", x, found)


def norm_rotate(x, weight, eps, rotation):
    """``rotation.apply(mx.fast.rms_norm(x, weight, eps))``."""
    dialect = qmv.dispatch(x)
    found = plan(rotation, x, dialect) if weight.dtype == x.dtype and weight.shape == (x.shape[-1],) else None
    if found is None:
        return rotation.apply(mx.fast.rms_norm(x, weight, eps))
    return launch(dialect, "norm", x, found, w=weight, eps=eps)


def swiglu_rotate(gate, up, rotation):
    """``rotation.apply(swiglu(gate, up))`` (mlx-lm's ``silu(gate) * up``)."""
    from mlx_lm.models.activations import swiglu

    dialect = qmv.dispatch(gate)
    found = plan(rotation, gate, dialect) if up.shape == gate.shape and up.dtype == gate.dtype else None
    if found is None:
        return rotation.apply(swiglu(gate, up))
    return launch(dialect, "swiglu", gate, found, x2=up)


# --- one decoder block of decode_step's split mode (mlx-lm's llama / qwen2 layout) ----------------

def _group(layers):
    from .fold import _group as group

    g = group(layers)
    return g if g is not None and g.bits in qmv.BITS else None


def _norm_input(norm, group):
    """(weight, rotation) with which the group's input is R rms_norm(h, weight): a folded norm's
    product with the signs and the group's rotation without them, a plain norm's weight and the
    signed rotation; None for anything else (the block then runs its own modules)."""
    import mlx.nn as nn

    from .fold import SignedRMSNorm

    if isinstance(norm, SignedRMSNorm) and group.norm is norm and norm.intact():
        if norm._source is not norm["weight"]:  # load_weights replaced the weight: fold it again
            norm._fold()
        return norm._folded, group.unsigned
    if type(norm) is nn.RMSNorm and group.norm is None:
        return norm["weight"], group.rotation
    return None


def _single(layer):
    from .qlinear import QuantizedEmbedding, QuantizedLinear

    return (isinstance(layer, QuantizedLinear) and not isinstance(layer, QuantizedEmbedding)
            and layer.__dict__.get("_fused") is None and layer.bits in qmv.BITS)


def _matvec(layer, xr, residual=None):
    """``layer``'s mat-vec of the rotated ``xr`` (+ ``residual`` in the epilogue where it fits)."""
    return qmv.launch(qmv.dispatch(xr), xr, layer["packed"], layer["scales"], layer["codebook"], layer.bits,
                      layer.get("bias"), layer.group_size, None, owner=layer, residual=residual)


def _normed(norm, group, h):
    """The group's rotated input ``R rms_norm(h)`` by the prep kernel, or None where it does not apply."""
    found = _norm_input(norm, group) if group is not None else None
    if found is None:
        return None
    weight, rotation = found
    dialect = qmv.dispatch(h)
    lay = plan(rotation, h, dialect) if weight.dtype == h.dtype and weight.shape == (h.shape[-1],) else None
    return None if lay is None else launch(dialect, "norm", h, lay, w=weight, eps=norm.eps)


def qkv(layer, h):
    """q, k, v of the block's attention for the residual stream ``h``: the input norm and the rotation
    in one prep launch, then the q|k|v mat-vec; else the block's own modules."""
    attn, norm = layer.self_attn, layer.input_layernorm
    group = _group([attn.q_proj, attn.k_proj, attn.v_proj]) if hasattr(attn, "q_proj") else None
    xr = _normed(norm, group, h)
    if xr is None:
        x = norm(h)
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return group.matvec(xr)


def _mlp_parts(mlp):
    """(gate|up group, down_proj, down's rotation, flip) of a SignedMLP or a plain llama/qwen2 MLP
    over vqpipe layers, or None."""
    from .fold import BLOCK_MODULES, SignedMLP

    if isinstance(mlp, SignedMLP):
        if not all(mlp.get(name) is child for name, child in mlp.layers):
            return None
        group, rotation, flip = mlp.group, mlp.unsigned, True
    elif type(mlp).__module__ in BLOCK_MODULES and set(mlp.children()) == {"gate_proj", "up_proj", "down_proj"}:
        group, rotation, flip = _group([mlp.gate_proj, mlp.up_proj]), mlp.down_proj.rotation, False
    else:
        return None
    if group is None or not _single(mlp.down_proj) or group.norm is not None and not flip:
        return None
    return group, mlp.down_proj, rotation, flip


def after_attention(layer, h, o, epilogue=False):
    """The block after attention for the residual stream ``h`` and attention output ``o`` ([1, 1, heads
    * head_dim]): o_proj's input rotated in one prep launch, the post-attention norm and rotation in
    one, SwiGLU and down's rotation in one (each only where it applies, else the block's own
    modules); ``epilogue``: the residual adds in the mat-vecs' epilogues (Decoder(epilogue=True))."""
    from .decode_step import _plus_linear, _plus_mlp

    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    o_proj = attn.o_proj
    dialect = qmv.dispatch(o)
    lay = plan(o_proj.rotation, o, dialect) if _single(o_proj) else None
    if lay is None:
        h = _plus_linear(o_proj, o, h) if epilogue else h + o_proj(o)
    else:
        xr = launch(dialect, "rotate", o, lay)
        h = _matvec(o_proj, xr, h) if epilogue else h + _matvec(o_proj, xr)
    parts = _mlp_parts(mlp)
    xr = None if parts is None else _normed(norm, parts[0], h)
    if xr is None:
        return _plus_mlp(mlp, norm(h), h) if epilogue else h + mlp(norm(h))
    group, down, rotation, flip = parts
    gate, up = group.matvec(xr, flip)
    xd = swiglu_rotate(gate, up, rotation)
    return _matvec(down, xd, h) if epilogue else h + _matvec(down, xd)


# --- a numpy model of the kernel (the same operations in the same order, float32) -----------------

def model(op, x, found, x2=None, w=None, eps=0.0):
    """What :func:`launch` computes, in numpy float32 in the kernel's order of operations (on the
    CPU: tests check the layout and the bound against float64 here; the GPU is checked against
    float64 too). ``x``: [..., D] array-like; returns float32 [..., D] (before the cast to T)."""
    sd, lmat, nt, kb, g = found
    f32 = np.float32
    a = lmat.shape[0]
    xs = np.asarray(x, dtype=f32)
    shape = xs.shape
    d = shape[-1]
    b = d // a
    v = xs.reshape(-1, d).copy()
    if op == "swiglu":
        u = np.asarray(x2, dtype=f32).reshape(v.shape)
        with np.errstate(over="ignore"):
            v = v / (f32(1) + np.exp(-v)) * u
    # [rows, a, k, t] with element a * B + k * NT + t
    v = v.reshape(-1, a, kb, nt)
    if op == "norm":
        per = np.zeros(v.shape[0::3], f32)  # [rows, NT]: each thread's sum over s = a * KB + k
        for s in range(a * kb):
            per += v[:, s // kb, s % kb, :] ** 2
        lanes = per.reshape(-1, nt // 32, 32)
        for h in (16, 8, 4, 2, 1):
            lanes = lanes + lanes[..., np.arange(32) ^ h]
        ss = np.zeros(v.shape[0], f32)
        for wi in range(nt // 32):
            ss += lanes[:, wi, 0]
        r = f32(1) / np.sqrt(ss / f32(d) + f32(eps))
        v = v * r[:, None, None, None] * np.asarray(w, f32).reshape(a, kb, nt)
    v = v * np.asarray(sd, f32).reshape(a, kb, nt)

    def bit(arr, axis, h):
        idx = np.arange(arr.shape[axis])
        lo = np.take(arr, idx & ~h, axis=axis)
        hi = np.take(arr, idx | h, axis=axis)
        return np.where(((idx & h) != 0).reshape([-1 if i == axis % arr.ndim else 1 for i in range(arr.ndim)]),
                        lo - hi, lo + hi)

    h = 1
    while h < kb:
        v = bit(v, 2, h)
        h *= 2
    h = 1
    while h < nt:
        v = bit(v, 3, h)
        h *= 2
    lm = np.asarray(lmat, f32)
    if a > 1:
        y = np.zeros_like(v)
        for a2 in range(a):
            y += lm[None, :, a2, None, None] * v[:, a2:a2 + 1]
        v = y
    return (v * (f32(1) / np.sqrt(f32(b)))).reshape(shape)


def _fwht64(v):
    """Sylvester transform (unnormalised) along the last axis, float64."""
    v = v.copy()
    n = v.shape[-1]
    h = 1
    while h < n:
        w = v.reshape(*v.shape[:-1], n // (2 * h), 2, h)
        lo, hi = w[..., 0, :].copy(), w[..., 1, :].copy()
        w[..., 0, :], w[..., 1, :] = lo + hi, lo - hi
        h *= 2
    return v


def reference64(op, x, rotation, x2=None, w=None, eps=0.0):
    """(y, magnitude) in float64: R f(x) from the float64 values of the inputs, and |R| |f(x)|
    (the scale of the float32 rounding bound), R = (L (x) S_B / sqrt(B)) diag(sd) from
    ``qmv.rotation_operands`` (|S_B| is all ones)."""
    sd, lmat = (np.asarray(t, np.float64) for t in qmv.rotation_operands(rotation))
    xs = np.asarray(x, np.float64)
    d = xs.shape[-1]
    a = lmat.shape[0]
    b = d // a
    v = xs.reshape(-1, d)
    if op == "swiglu":
        v = v / (1 + np.exp(-v)) * np.asarray(x2, np.float64).reshape(v.shape)
    if op == "norm":
        v = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)
    v = (v * sd).reshape(-1, a, b)
    y = np.einsum("ij,rjb->rib", lmat, _fwht64(v)) / math.sqrt(b)
    mag = np.einsum("ij,rj->ri", np.abs(lmat), np.abs(v).sum(-1)) / math.sqrt(b)
    return y.reshape(xs.shape), np.repeat(mag[:, :, None], b, axis=2).reshape(xs.shape)


def bound(op, found, mag, y, dtype_eps):
    """The float32 rounding bound of :func:`launch` against :func:`reference64` plus one cast (half
    an ulp of |y| at ``dtype_eps``): n * 2^-24 * |R| |f(x)| with n = log2(B) butterfly stages + A
    multiply-adds + the scale + what f adds (norm: the sum of squares' additions in sequence,
    halved by the root, then the root, division and two products; SwiGLU: expf (<= 2 ulp), one
    add, one division, one product)."""
    _, lmat, nt, kb, _ = found
    a = lmat.shape[0]
    n = int(math.log2(nt * kb)) + a + 4
    if op == "norm":
        n += (a * kb + 5 + nt // 32) // 2 + 8
    if op == "swiglu":
        n += 8
    err = n * 2.0**-24 * mag
    return err + dtype_eps / 2 * (np.abs(y) + err) + 1e-30
