"""The trellis mat-vec on Metal (``mx.fast.metal_kernel``): csrc/trellis.cu's kernel in Metal.

Written from the same description as the CUDA kernel and **never compiled or run here** (no Apple
machine): a threadgroup of 8 simdgroups owns one row block (32 rows); each simdgroup copies chunks
of 4 tiles to threadgroup memory, lane l decodes weights 8l..8l+7 of each tile (column l / 4, rows
8(l % 4)..+7) from one 64-bit window of the stream holding the ceil(L / k) steps before them, the
1MAD code computed in registers. Sums: across the lanes of a row group by ``simd_shuffle_xor``,
across simdgroups through threadgroup memory, in a fixed order. At most 8 rows of x per launch.
"""

import math

import mlx.core as mx

from ..codec import trellis
from ..gpu import backend

MAX_M = 8
WARPS = 8  # simdgroups per threadgroup (the source's 8; 4 tiles a pass)

HEADER = f"""
inline float vq_code(uint s, float a, float b) {{
    uint h = s * {trellis.LCG[0]}u + {trellis.LCG[1]}u;
    uint sum = (h & 255u) + ((h >> 8) & 255u) + ((h >> 16) & 255u) + (h >> 24);
    return metal::precise::fma(a, float(sum), b);
}}
"""

# K (bits per step), MC (rows of x), T (x's dtype) are template arguments; L, n = ceil(L / K),
# cols and rows are the ``dims`` input, the code's (a, b) the ``ab`` input.
SOURCE = """
    constexpr int W = 8 * K;
    threadgroup uint words[8][4 * W + 2];
    threadgroup float part[8][8][32];
    const uint warp = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
    const uint rb = threadgroup_position_in_grid.x;
    const int L = dims[0], n = dims[1], cols = dims[2], rows = dims[3];
    const float ca = ab[0], cb = ab[1];
    const int tiles = cols / 8;
    const uint mask = (1u << L) - 1u, kmask = (1u << K) - 1u;
    const device uint* base = packed + (ulong)rb * tiles * W;
    const int first = 8 * int(lane) - (n - 1);
    const int p0 = first < 0 ? 0 : K * first, pad = first < 0 ? -K * first : 0;
    float acc[MC][8];
    for (int m = 0; m < MC; ++m)
        for (int r = 0; r < 8; ++r) acc[m][r] = 0.0f;
    if (lane < 2) words[warp][4 * W + lane] = 0u;
    for (int c0 = int(warp) * 4; c0 < tiles; c0 += 8 * 4) {
        const int nt = min(4, tiles - c0);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int i = int(lane); i < nt * W; i += 32) words[warp][i] = base[(ulong)c0 * W + i];
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int t = 0; t < nt; ++t) {
            const threadgroup uint* tw = words[warp] + t * W;
            const int wi = p0 >> 5, sh = p0 & 31;
            const ulong lo = ulong(tw[wi]) | (ulong(tw[wi + 1]) << 32);
            ulong win = sh ? (lo >> sh) | (ulong(tw[wi + 2]) << (64 - sh)) : lo;
            win <<= pad;
            uint s = 0;
            for (int j = 0; j < n - 1; ++j) s = ((s << K) | uint((win >> (K * j)) & kmask)) & mask;
            win >>= K * (n - 1);
            const int col = (c0 + t) * 8 + int(lane >> 2);
            float xv[MC];
            for (int m = 0; m < MC; ++m) xv[m] = float(x[(ulong)m * cols + col]);
            for (int r = 0; r < 8; ++r) {
                s = ((s << K) | uint((win >> (K * r)) & kmask)) & mask;
                const float v = vq_code(s, ca, cb);
                for (int m = 0; m < MC; ++m) acc[m][r] = metal::precise::fma(v, xv[m], acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MC; ++m) {
        for (int r = 0; r < 8; ++r) {
            float v = acc[m][r];
            v += simd_shuffle_xor(v, 4);
            v += simd_shuffle_xor(v, 8);
            v += simd_shuffle_xor(v, 16);
            if (lane < 4) part[warp][m][8 * lane + r] = v;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint tid = warp * 32 + lane;
    if (tid < 32u * MC) {
        const uint m = tid >> 5, r = tid & 31u;
        const ulong row = (ulong)rb * 32 + r;
        float v = 0.0f;
        for (int w = 0; w < 8; ++w) v += part[w][m][r];
        v *= scales[row];
        BIAS
        y[(ulong)m * rows + row] = T(v);
    }
"""

_kernels = {}
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def dispatch(x):
    """Whether a trellis layer's call on ``x`` runs this kernel: Metal on the default device,
    1 <= M <= MAX_M, a float dtype. Runs per layer per token, so it is kept cheap."""
    return 0 < math.prod(x.shape[:-1]) <= MAX_M and x.dtype in DTYPES and backend() == "metal"


def _kernel(has_bias):
    if has_bias not in _kernels:
        inputs = ["x", "packed", "scales", "dims", "ab"] + (["bias"] if has_bias else [])
        _kernels[has_bias] = mx.fast.metal_kernel(
            name=f"vqpipe_trellis_matvec{'_bias' if has_bias else ''}", input_names=inputs, output_names=["y"],
            source=SOURCE.replace("BIAS", "v += bias[row];" if has_bias else ""), header=HEADER)
    return _kernels[has_bias]


def matvec(xr, packed, scales, bits, L, code_scale, bias=None):
    """``s * (C @ xr) + b`` of a trellis layer along xr's last axis (1 <= M <= MAX_M rows), in xr's
    dtype, on Metal. The same arguments as vqpipe/kernels/ext.py ``trellis_matvec``."""
    cols, rows = xr.shape[-1], packed.shape[0] * trellis.TILE_ROWS
    m = xr.size // cols
    if not 1 <= m <= MAX_M:
        raise ValueError(f"trellis_metal: x has M = {m} rows; the kernel takes 1..{MAX_M}")
    a, b = trellis.code_affine(L, code_scale)
    n = -(-L // bits)
    inputs = [xr.reshape(m, cols), packed, scales.astype(mx.float32), mx.array([L, n, cols, rows], mx.int32),
              mx.array([float(a), float(b)], mx.float32)]
    if bias is not None:
        inputs.append(bias.astype(mx.float32))
    (y,) = _kernel(bias is not None)(
        inputs=inputs, template=[("K", bits), ("MC", m), ("T", xr.dtype)],
        grid=(32 * WARPS * packed.shape[0], 1, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(m, rows)], output_dtypes=[xr.dtype])
    return y.reshape(*xr.shape[:-1], rows)
