"""Fused codebook mat-vec ("qmv") for the decode case: one kernel description, a CUDA/Metal dialect
layer, dispatch.

For a :class:`vqpipe.qlinear.QuantizedLinear` with packed indices q (out x in), row scales s, codebook C
and optional bias b, and the rotated activation xr (M rows, M small: decode has M = 1):

    y[m, o] = s[o] * sum_i C[q[o, i]] * xr[m, i]  (+ b[o])

The dense path rebuilds the whole weight C[q] (out x in) on every call; the kernel reads each packed
word once and never materialises the weight, so a decode step costs about the packed bytes.

Layout (see docs/qmv.md):

- A lane's unit of work is one *chunk*: the 32-bit window holding 8 values (3 and 4 bits), 16 values
  (2 bits) or 4 values (8 bits). For 2/4/8 bits that is exactly word c of the row; a 3-bit chunk is
  bits [24c, 24c + 24) of the row's stream and may straddle two words. Consecutive lanes take
  consecutive chunks, so both the packed words (128 B per row per warp step) and the activation
  (8 values per lane, contiguous across lanes) are read coalesced.
- One warp (SIMD group) owns R = 4 rows: the activation chunk it loads is reused for the 4 rows.
  U = 4 warp steps per iteration; the first iteration's words are requested before the codebook
  barrier, and every iteration requests the next one's before computing, so a warp keeps up to
  2 x U x R words per lane in flight (bandwidth, not arithmetic, bounds this kernel).
- KS warps (1, 2, 4 or 8) split the chunks of the same 4 rows when there are few rows or long rows
  (e.g. the 4864 -> 896 down projection); their partial sums meet in shared memory and are added in
  warp order. KS is chosen per shape at launch time and reaches the kernel as the threadgroup's y
  size, so it is not a template argument.
- The codebook (2**bits floats) sits in shared memory: with at most 32 levels every level has its
  own bank, so the per-value lookups never conflict.
- float32 accumulation: each lane sums its chunks in a fixed order, then a 5-step xor-shuffle
  butterfly, then the KS partials in warp order, then * s[o] (+ b[o]) and one cast to x's dtype.
  No atomics: the result is deterministic (same bytes every run on the same device), but it is not
  bit-identical to the dense path (which works in x's dtype, codebook included).

Shapes reach the kernel at run time (``x_shape``, ``packed_shape``, ``bias_ndim``); the template
arguments are x's dtype, the bias dtype, bits and M rounded up to 1, 2, 4 or 8, so the number of
compiled kernels is bounded and does not grow with the layer shapes.
"""

import contextlib
import functools
import hashlib
import math
import os
import re

import mlx.core as mx

from . import gpu
from .gpu import backend
from .packing import unpack, words_per_row

MAX_M = 8  # rows of x (prod of its leading dims) the kernel takes; more -> the dense path
ROWS = 4  # output rows per warp (R)
UNROLL = 4  # warp steps per iteration (U); must match "constexpr int U" in _SOURCE
TARGET_WARPS = 4096  # enough warps to fill an H200 (132 SMs x ~32 resident warps)
BITS = (2, 3, 4, 8)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# The kernel description. Compile-time names (from MLX's template arguments): T (x dtype), BT (bias
# dtype; only keeps kernels with different bias signatures apart in MLX's by-name cache), BITS, MT.
# Dialect tokens QMV_* are substituted in Python; helpers qmv_* come from the dialect header.
_SOURCE = """
    constexpr int R = 4;                                // rows per warp
    constexpr int U = 4;                                // warp steps per iteration (loads in flight)
    constexpr int CH = (BITS == 3) ? 8 : 32 / BITS;     // values per lane chunk (one 32-bit window)
    constexpr int SC = CH < 8 ? CH : 8;                 // values per activation load
    constexpr int NLEV = 1 << BITS;
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    QMV_SHARED float cb_s[NLEV];
    QMV_SHARED float red_s[8 * R * MT];

    const unsigned int lane = QMV_LANE;
    const unsigned int ks = QMV_KS_ID;                  // which slice of the row's chunks
    const unsigned int KS = QMV_KS;
    const unsigned int rw = QMV_RW_ID;                  // which row set of this block
    const unsigned int RW = QMV_RW;
    const unsigned int tid = (rw * KS + ks) * 32u + lane;
    const unsigned int M = x_shape[0];
    const unsigned int PIN = x_shape[1];                // in_features padded to a multiple of 32
    const unsigned int OUT = packed_shape[0];
    const unsigned int WPR = packed_shape[1];           // words per row
    const unsigned int NCH = PIN / CH;
    const unsigned int STRIDE = 32u * KS * U;           // chunks one warp advances per iteration
    const bool has_bias = bias_ndim == 1;               // the no-bias placeholder is 2-D
    const unsigned int row0 = (QMV_BLOCK * RW + rw) * R;
    // uniform per warp: all 32 lanes share row0, so whole warps skip and the shuffles stay full
    const bool active = row0 < OUT;

    unsigned int base[R];
    QMV_UNROLL
    for (int r = 0; r < R; ++r) {
        // a partial last row set re-reads the last row; those sums are never written
        base[r] = qmv_umin(row0 + (unsigned int)r, OUT - 1u) * WPR;
    }
    // The first iteration's words are requested before the codebook barrier, and each
    // iteration requests the next one's before it computes: a warp keeps loads in flight.
    unsigned int win[U][R];
    QMV_UNROLL
    for (int u = 0; u < U; ++u) {
        const unsigned int c = ks * 32u + (unsigned int)u * 32u * KS + lane;
        QMV_UNROLL
        for (int r = 0; r < R; ++r) {
            win[u][r] = (active && c < NCH) ? qmv_window<BITS, CH>(packed, base[r], c) : 0u;
        }
    }
    for (unsigned int i = tid; i < (unsigned int)NLEV; i += RW * KS * 32u) {
        cb_s[i] = codebook[i];
    }
    QMV_BARRIER;

    float acc[R][MT];
    QMV_UNROLL
    for (int r = 0; r < R; ++r) {
        QMV_UNROLL
        for (int m = 0; m < MT; ++m) {
            acc[r][m] = 0.0f;
        }
    }
    if (active) {
        const bool vec = QMV_X_ALIGNED(x);
        for (unsigned int c0 = ks * 32u; c0 < NCH; c0 += STRIDE) {
            unsigned int nxt[U][R];
            QMV_UNROLL
            for (int u = 0; u < U; ++u) {
                const unsigned int c = c0 + STRIDE + (unsigned int)u * 32u * KS + lane;
                QMV_UNROLL
                for (int r = 0; r < R; ++r) {
                    nxt[u][r] = c < NCH ? qmv_window<BITS, CH>(packed, base[r], c) : 0u;
                }
            }
            QMV_UNROLL
            for (int u = 0; u < U; ++u) {
                const unsigned int c = c0 + (unsigned int)u * 32u * KS + lane;
                if (c < NCH) {
                    QMV_UNROLL
                    for (int h = 0; h < CH / SC; ++h) {
                        float xv[MT][SC];
                        QMV_UNROLL
                        for (int m = 0; m < MT; ++m) {
                            // rows past M repeat the last row; their sums are never written
                            const unsigned int mm = qmv_umin((unsigned int)m, M - 1u);
                            QMV_LOAD_X(xv[m], x + mm * PIN + c * CH + h * SC, vec);
                        }
                        QMV_UNROLL
                        for (int r = 0; r < R; ++r) {
                            QMV_UNROLL
                            for (int t = 0; t < SC; ++t) {
                                const float w = cb_s[(win[u][r] >> (BITS * (h * SC + t))) & MASK];
                                QMV_UNROLL
                                for (int m = 0; m < MT; ++m) {
                                    acc[r][m] += w * xv[m][t];
                                }
                            }
                        }
                    }
                }
            }
            QMV_UNROLL
            for (int u = 0; u < U; ++u) {
                QMV_UNROLL
                for (int r = 0; r < R; ++r) {
                    win[u][r] = nxt[u][r];
                }
            }
        }
        QMV_UNROLL
        for (int r = 0; r < R; ++r) {
            QMV_UNROLL
            for (int m = 0; m < MT; ++m) {
                float v = acc[r][m];
                QMV_UNROLL
                for (int s = 16; s > 0; s /= 2) {
                    v += qmv_shfl_xor(v, s);
                }
                acc[r][m] = v;
            }
        }
        if (lane == 0u) {
            QMV_UNROLL
            for (int r = 0; r < R; ++r) {
                QMV_UNROLL
                for (int m = 0; m < MT; ++m) {
                    red_s[((rw * KS + ks) * R + r) * MT + m] = acc[r][m];
                }
            }
        }
    }
    QMV_BARRIER;
    // one thread per (row set, row, m): the KS partials in warp order, then scale, bias, one cast
    if (tid < RW * R * MT) {
        const unsigned int srw = tid / (R * MT);
        const unsigned int r = (tid / MT) % R;
        const unsigned int m = tid % MT;
        const unsigned int o = (QMV_BLOCK * RW + srw) * R + r;
        if (o < OUT && m < M) {
            float s = red_s[((srw * KS) * R + r) * MT + m];
            for (unsigned int k = 1; k < KS; ++k) {
                s += red_s[((srw * KS + k) * R + r) * MT + m];
            }
            s *= scales[o];
            if (has_bias) {
                s += static_cast<float>(bias[o]);
            }
            out[m * OUT + o] = static_cast<T>(s);
        }
    }
"""

INPUT_NAMES = ["x", "packed", "scales", "codebook", "bias"]
OUTPUT_NAMES = ["out"]

_CUDA_HEADER = """
__device__ __forceinline__ unsigned int qmv_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
__device__ __forceinline__ float qmv_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }

// The 32-bit window of chunk c of a row starting at word `base`: word c for 2/4/8 bits; for 3 bits
// stream bits [24c, 24c + 24), which straddle into the next word when they start at bit 16 or 24.
template <int BITS, int CH>
__device__ __forceinline__ unsigned int qmv_window(const unsigned int* p, unsigned int base, unsigned int c) {
    if (CH * BITS == 32) {
        return p[base + c];
    }
    const unsigned int bit = c * (unsigned int)(CH * BITS);
    const unsigned int wi = bit >> 5;
    const unsigned int sh = bit & 31u;
    const unsigned int lo = p[base + wi];
    if (sh + CH * BITS <= 32u) {
        return lo >> sh;
    }
    return (lo >> sh) | (p[base + wi + 1u] << (32u - sh));  // here 0 < sh < 32
}

// N consecutive activations as float; 16-byte (8-byte for 8 bytes in all) vector loads when x is
// 16-byte aligned (MLX passes views with their offset, so this is checked, not assumed).
template <typename T, int N>
struct alignas(sizeof(T) * N) qmv_vec {
    T val[N];
};

template <int N, typename T>
__device__ __forceinline__ void qmv_load_x(float* dst, const T* p, bool vec) {
    constexpr int P = (int)(N * sizeof(T)) > 16 ? (int)(16 / sizeof(T)) : N;
    if (vec) {
#pragma unroll
        for (int k = 0; k < N / P; ++k) {
            const qmv_vec<T, P> v = reinterpret_cast<const qmv_vec<T, P>*>(p)[k];
#pragma unroll
            for (int i = 0; i < P; ++i) {
                dst[k * P + i] = static_cast<float>(v.val[i]);
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            dst[i] = static_cast<float>(p[i]);
        }
    }
}
#define QMV_LOAD_X(dst, p, vec) qmv_load_x<SC>(dst, p, vec)
#define QMV_X_ALIGNED(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull)
"""

# Untested: no Apple GPU was available. Scalar activation loads (Apple GPUs coalesce them).
_METAL_HEADER = """
inline unsigned int qmv_umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline float qmv_shfl_xor(float v, int m) { return metal::simd_shuffle_xor(v, ushort(m)); }

template <int BITS, int CH>
inline unsigned int qmv_window(const device uint32_t* p, unsigned int base, unsigned int c) {
    if (CH * BITS == 32) {
        return p[base + c];
    }
    const unsigned int bit = c * (unsigned int)(CH * BITS);
    const unsigned int wi = bit >> 5;
    const unsigned int sh = bit & 31u;
    const unsigned int lo = p[base + wi];
    if (sh + CH * BITS <= 32u) {
        return lo >> sh;
    }
    return (lo >> sh) | (p[base + wi + 1u] << (32u - sh));
}
#define QMV_LOAD_X(dst, p, vec) for (int t_ = 0; t_ < SC; ++t_) { (dst)[t_] = static_cast<float>((p)[t_]); }
#define QMV_X_ALIGNED(p) false
"""

DIALECTS = {
    "cuda": {
        "header": _CUDA_HEADER,
        "tokens": {
            "QMV_SHARED": "__shared__",
            "QMV_BARRIER": "__syncthreads()",
            "QMV_LANE": "threadIdx.x",
            "QMV_KS_ID": "threadIdx.y",
            "QMV_KS": "blockDim.y",
            "QMV_RW_ID": "threadIdx.z",
            "QMV_RW": "blockDim.z",
            "QMV_BLOCK": "blockIdx.x",
            "QMV_UNROLL": "#pragma unroll",
        },
    },
    "metal": {
        "header": _METAL_HEADER,
        "tokens": {
            "QMV_SHARED": "threadgroup",
            "QMV_BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
            "QMV_LANE": "thread_position_in_threadgroup.x",
            "QMV_KS_ID": "thread_position_in_threadgroup.y",
            "QMV_KS": "threads_per_threadgroup.y",
            "QMV_RW_ID": "thread_position_in_threadgroup.z",
            "QMV_RW": "threads_per_threadgroup.z",
            "QMV_BLOCK": "threadgroup_position_in_grid.x",
            "QMV_UNROLL": "#pragma unroll",
        },
    },
}
# Tokens the dialect headers define as macros (left in the body on purpose).
_HEADER_MACROS = ("QMV_LOAD_X", "QMV_X_ALIGNED")

_kernels = {}  # dialect -> MLX kernel object, built once
_instances = set()  # (dialect, dtype, bias dtype, bits, MT): one JIT-compiled kernel each
_enabled = os.environ.get("VQPIPE_QMV_KERNELS", "1") != "0"
_placeholders = {}  # dtype -> the 2-D stand-in passed as `bias` when a layer has none


def render(dialect):
    """(name, header, body) of the kernel in one dialect. The name carries a digest of the source:
    MLX caches compiled kernels (in memory and as PTX on disk) by name alone."""
    spec = DIALECTS[dialect]
    body = _SOURCE
    for token, text in spec["tokens"].items():
        body = re.sub(rf"\b{token}\b", text, body)
    digest = hashlib.sha1((spec["header"] + body).encode()).hexdigest()[:10]
    return f"vqpipe_qmv_{digest}", spec["header"], body


def set_enabled(flag):
    """Global switch (also ``VQPIPE_QMV_KERNELS=0`` at import). Returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


def is_enabled():
    return _enabled


@contextlib.contextmanager
def enabled(flag):
    """``with qmv.enabled(False): ...`` runs the block with the switch set, then restores it."""
    previous = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(previous)


def kernels_active(use_kernels=None):
    """Whether a call with ``use_kernels`` runs the fused kernel: None follows the global switch and
    the backend; True insists (raises if there is no GPU backend); False never."""
    return gpu.active(use_kernels, _enabled, backend(), "the qmv kernel")


def rows_of(x):
    """M: the number of activation rows, the product of all but the last dimension."""
    return math.prod(x.shape[:-1])


def dispatch(x):
    """The decision of ``QuantizedLinear.__call__`` for activation ``x``: the dialect to launch in
    (switch on, 1 <= M <= MAX_M, a supported dtype, a GPU backend on the default device), else None:
    the layer then runs its dense path unchanged. Runs per layer per token, so it is kept cheap."""
    if not _enabled:
        return None
    shape = x.shape
    if not 0 < math.prod(shape[:-1]) <= MAX_M or x.dtype not in DTYPES:
        return None
    return backend()


def use_kernel(x):
    """``dispatch(x) is not None``."""
    return dispatch(x) is not None


def compiled_kernel_count():
    """Distinct kernels compiled so far (one per dialect, dtype, bias dtype, bits and MT)."""
    return len(_instances)


def _kernel(dialect):
    if dialect not in _kernels:
        name, header, body = render(dialect)
        make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
        _kernels[dialect] = make(
            name=name, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES, source=body, header=header
        )
    return _kernels[dialect]


def _pow2_floor(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


def _pow2_ceil(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def check_args(in_features, m, packed_shape, packed_dtype, scales_shape, codebook_size, bias_shape, bits, dtype):
    """Raise ValueError naming the first thing that does not fit the kernel."""
    if bits not in BITS:
        raise ValueError(f"qmv: bits must be one of {BITS}, got {bits!r}")
    if dtype not in DTYPES:
        raise ValueError(f"qmv: x dtype must be float16, bfloat16 or float32, got {dtype}")
    if in_features < 1:
        raise ValueError(f"qmv: x has an empty last dimension ({in_features})")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"qmv: x has M = {m} rows (product of its leading dims); the kernel takes 1..{MAX_M}")
    if packed_dtype != mx.uint32:
        raise ValueError(f"qmv: packed must be uint32, got {packed_dtype}")
    if len(packed_shape) != 2:
        raise ValueError(f"qmv: packed must be 2-D [out, words], got shape {tuple(packed_shape)}")
    out_features, words = packed_shape
    if out_features < 1:
        raise ValueError("qmv: packed has no rows (out_features = 0)")
    if words != words_per_row(in_features, bits):
        raise ValueError(
            f"qmv: packed has {words} words per row; {in_features} input features at {bits} bits "
            f"need {words_per_row(in_features, bits)} (in_features of x and packed disagree?)"
        )
    if tuple(scales_shape) != (out_features,):
        raise ValueError(f"qmv: scales must have shape ({out_features},), got {tuple(scales_shape)}")
    if codebook_size != 1 << bits:
        raise ValueError(f"qmv: a {bits}-bit codebook has {1 << bits} levels, got {codebook_size}")
    if bias_shape is not None and tuple(bias_shape) != (out_features,):
        raise ValueError(f"qmv: bias must have shape ({out_features},), got {tuple(bias_shape)}")
    if out_features * words >= 2**31 or m * out_features >= 2**31 or m * -(-in_features // 32) * 32 >= 2**31:
        raise ValueError("qmv: the kernel indexes with 32-bit integers; split the layer")


@functools.lru_cache(maxsize=1024)
def launch_spec(x_shape, packed_shape, scales_shape, codebook_size, bias_shape, bits, dtype, bias_dtype=None,
                packed_dtype=mx.uint32):
    """Validate one call (ValueError naming the problem) and return its template arguments, grid,
    threadgroup and output shape (cached: per call this is one dict lookup; read-only). Only the
    template arguments select a compiled kernel, and they hold no shape: M enters as MT, M rounded
    up to a power of two (1, 2, 4, 8), and the row split KS as the threadgroup's y size."""
    in_features = x_shape[-1] if x_shape else 0
    m = math.prod(x_shape[:-1]) if x_shape else 0
    check_args(in_features, m, packed_shape, packed_dtype, scales_shape, codebook_size, bias_shape, bits, dtype)
    out_features = packed_shape[0]
    padded = -(-in_features // 32) * 32
    chunk = 8 if bits == 3 else 32 // bits
    steps = -(-(padded // chunk) // 32)  # warp steps per row
    row_sets = -(-out_features // ROWS)
    # Split rows over more warps only while there are too few warps to fill the GPU, and never so
    # far that a warp has less than one unrolled iteration of work.
    cap = _pow2_floor(min(8, max(1, -(-steps // UNROLL))))
    ks = min(cap, _pow2_ceil(-(-TARGET_WARPS // row_sets)))
    rw = max(1, 4 // ks)  # row sets per threadgroup: 128 threads, 256 when KS = 8
    blocks = -(-row_sets // rw)
    return {
        "template": [("T", dtype), ("BT", dtype if bias_dtype is None else bias_dtype), ("BITS", int(bits)),
                     ("MT", _pow2_ceil(m))],
        "grid": (32 * blocks, ks, rw),
        "threadgroup": (32, ks, rw),
        "output_shapes": [(m, out_features)],
        "output_dtypes": [dtype],
        "m": m,
        "padded_in": padded,
    }


def _placeholder(dtype):
    if dtype not in _placeholders:
        _placeholders[dtype] = mx.zeros((1, 1), dtype)
    return _placeholders[dtype]


def reference(xr, packed, scales, codebook, bits, bias=None):
    """The dense path, exactly as ``QuantizedLinear.__call__`` computes it from the rotated input:
    rebuild C[q] in x's dtype, one matmul, then scales and bias in x's dtype."""
    dt = xr.dtype
    y = xr @ codebook.astype(dt)[unpack(packed, bits, xr.shape[-1])].T
    y = y * scales.astype(dt)
    if bias is not None:
        y = y + bias.astype(dt)
    return y


def quantized_matvec(xr, packed, scales, codebook, bits, bias=None, use_kernels=None):
    """``scales * (codebook[unpack(packed)] @ xr) + bias`` along the last axis of ``xr`` (the
    already rotated activation), in ``xr``'s dtype.

    With the kernel active (``use_kernels``: None = switch and backend, True = insist, False = never)
    and M = prod(xr.shape[:-1]) <= MAX_M this is one fused launch; otherwise :func:`reference`.
    ``use_kernels=True`` raises on arguments the kernel cannot take (the message names the problem).
    """
    if not kernels_active(use_kernels):
        return reference(xr, packed, scales, codebook, bits, bias)
    if use_kernels is None and not (0 < rows_of(xr) <= MAX_M and xr.dtype in DTYPES):
        return reference(xr, packed, scales, codebook, bits, bias)
    return launch(backend(), xr, packed, scales, codebook, bits, bias)


_prepared = {}  # argument signature -> (launch spec, whether scales / codebook need a float32 cast)


def _prepare(key, dialect, bits):
    (x_shape, x_dtype, p_shape, p_dtype, s_shape, s_dtype, c_shape, c_dtype, b_sig, _, _) = key
    spec = launch_spec(x_shape, p_shape, s_shape, math.prod(c_shape), None if b_sig is None else b_sig[0], bits,
                       x_dtype, None if b_sig is None else b_sig[1], p_dtype)
    _instances.add((dialect, *(str(v) for _, v in spec["template"])))
    _prepared[key] = entry = (spec, s_dtype != mx.float32, c_dtype != mx.float32)
    return entry


def launch(dialect, xr, packed, scales, codebook, bits, bias=None):
    """One fused launch in ``dialect`` (no switch or backend check: see :func:`quantized_matvec`).
    Arguments are validated once per signature (shapes, dtypes, bits), then looked up."""
    key = (xr.shape, xr.dtype, packed.shape, packed.dtype, scales.shape, scales.dtype, codebook.shape,
           codebook.dtype, None if bias is None else (bias.shape, bias.dtype), bits, dialect)
    spec, cast_scales, cast_codebook = _prepared.get(key) or _prepare(key, dialect, int(bits))
    m, in_features = spec["m"], xr.shape[-1]
    x2 = xr.reshape(m, in_features)
    if spec["padded_in"] != in_features:  # zeros past in_features: the padded indices then add nothing
        x2 = mx.pad(x2, [(0, 0), (0, spec["padded_in"] - in_features)])
    (y,) = _kernel(dialect)(
        inputs=[
            x2,
            packed,
            scales.astype(mx.float32) if cast_scales else scales,
            codebook.astype(mx.float32) if cast_codebook else codebook,
            _placeholder(xr.dtype) if bias is None else bias,
        ],
        template=spec["template"],
        grid=spec["grid"],
        threadgroup=spec["threadgroup"],
        output_shapes=spec["output_shapes"],
        output_dtypes=spec["output_dtypes"],
    )
    return y.reshape(*xr.shape[:-1], spec["output_shapes"][0][1])
