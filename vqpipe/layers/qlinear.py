"""QuantizedLinear: rotated, row-normalised weights on a Lloyd-Max codebook, bit-packed.

For a weight W (out x in) with rows w_i, norm n_i and rotation R (in x in):
    q_i = nearest codebook levels of R w_i / n_i          (bits per entry, packed)
    y   = s * (C[q] @ (R x)) + b,                         s_i = n_i * <u_i, c_i> / <c_i, c_i>
where u_i = R w_i / n_i and c_i = C[q_i]: s_i is the least-squares row scale, the norm corrected for
the shrinkage of the quantized row. The activation is rotated, not the weights (O(d log d) per
token for Hadamard rotations), and the weights are dequantized on the fly, never kept resident.

With ``group_size`` g, ``scales`` is [out, in / g] (float16): entry i of a rotated row is scaled by
scales[o, i // g]. With calibration second moments H (``hessian``), the codes come from GPTQ error
feedback in the rotated basis and the scales from an H-weighted least-squares fit (vqpipe/codec/gptq.py).

With ``codes`` "trellis" (issue 34) the rotated weight is bitshift-trellis codes instead
(vqpipe/codec/trellis.py, tiles of 32 rows x 8 columns, block LDLQ: vqpipe/codec/ldlq.py): packed
holds the tiles' k-bit streams, codebook the value of each of the 2^L states, scales one float32
per row. Decode on the CPU takes the compiled trellis mat-vec; everything else decodes the states
and runs the dense path.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..kernels import dequant, dispatch, ext, qmv, trellis_metal
from ..kernels.dequant import dense_forward
from .head import Head
from ..codec import gptq, ldlq, trellis
from ..codec import rotation as rot
from ..codec.codebook import LAYER_BITS, boundaries, check_bits, codebook
from ..codec.bitpack import pack, unpack
from ..parallel import Pool

_ROW_CHUNK = 8192  # rows quantized at a time: bounds temporaries for 150k-row embeddings
_JOB_PARTS = 2  # pool jobs per layer (_job_rows)
CODES = ("scalar", "trellis")
TRELLIS_BITS = (2, 3, 4, 5)  # trellis widths: at 6 and 8 the Viterbi is 2^k-way for little gain


def trellis_fits(bits, out_features, in_features, group_size=None):
    """Whether a layer of this shape and width can take trellis codes (else it stays scalar)."""
    return (bits in TRELLIS_BITS and group_size is None and out_features % trellis.TILE_ROWS == 0
            and in_features % trellis.GROUP == 0)


def quantize_trellis(weight, bits, rotation, hessian=None, damp=None, pool=None):
    """Trellis codes of ``weight`` (out x in) -> (packed, scales, table, squared_error), as
    quantize_weight returns; with ``pool``, a function that gives them. The MLX part (rotation, the
    factors of H) runs here, block LDLQ (numpy and the compiled Viterbi) on ``pool``."""
    h = m = None
    if hessian is not None:
        h, n = _rotated_factors(hessian, rotation, gptq.DAMP if damp is None else damp)
        m = _feedback(n)
    w = rotation.apply(weight.astype(mx.float32))
    mx.eval(w)
    job = (pool or Pool(1)).submit(_trellis_rows, np.asarray(w), bits, h, m)

    def finish():
        packed, scales, error = job.result()
        return mx.array(packed), mx.array(scales), mx.array(trellis.table()), error

    return finish if pool is not None else finish()


def _trellis_rows(w, bits, h, m):
    packed, scales, c = ldlq.ldlq(w, bits, h, m)
    e = w - c * scales[:, None]
    return packed, scales, float(np.einsum("ij,ij->", e, e, dtype=np.float64))


_FEEDBACK = []  # [(n, m)]: the last few block feedback matrices (siblings share one factor n)


def _feedback(n):
    for n_, m in _FEEDBACK:
        if n_ is n:
            return m
    m = ldlq.block_feedback(n)
    _FEEDBACK[:] = [(n, m)] + _FEEDBACK[: _KEEP - 1]
    return m


def quantize_weight(weight, bits, rotation, group_size=None, hessian=None, damp=None, pool=None):
    """Quantize ``weight`` (out x in) -> (packed, scales, codebook, squared_error).

    ``squared_error`` is ||W - W_hat||^2, computed in the rotated space (R is orthogonal).
    Without ``group_size`` and ``hessian`` this is the data-free per-row method, unchanged.
    With ``pool`` (vqpipe/parallel.py) the numpy work of group scales / GPTQ runs there and this
    returns a function that gives the tuple (call it on the thread that uses MLX).
    """
    check_bits(bits, LAYER_BITS)
    if group_size is not None or hessian is not None:
        finish = _quantize_grouped(weight, bits, rotation, group_size, hessian, damp, pool or Pool(1))
        return finish if pool is not None else finish()
    if pool is not None:
        done = quantize_weight(weight, bits, rotation)
        return lambda: done
    out_features, in_features = weight.shape
    levels = codebook(bits, in_features)
    bounds = boundaries(levels).astype(np.float32)
    root = math.sqrt(in_features)
    packed, scales, error = [], [], 0.0
    for start in range(0, out_features, _ROW_CHUNK):
        w = weight[start : start + _ROW_CHUNK].astype(mx.float32)
        norms = mx.sqrt(mx.sum(w * w, axis=-1))
        u = rotation.apply(w / mx.maximum(norms, 1e-30)[:, None]) * root
        t = np.array(u, dtype=np.float32)
        norms = np.array(norms, dtype=np.float64)
        # Index = number of thresholds below t: 2^bits - 1 vector compares beat a binary search.
        idx = np.zeros(t.shape, dtype=np.uint8)
        for b in bounds:
            idx += t > b
        c = levels[idx]
        dot = np.einsum("ij,ij->i", t, c, dtype=np.float64)
        cc = np.einsum("ij,ij->i", c, c, dtype=np.float64)
        s = norms * dot / np.maximum(cc, 1e-300)
        # ||n u - s c||^2 / d per row, in the sqrt(d)-scaled units.
        tt = np.einsum("ij,ij->i", t, t, dtype=np.float64)
        error += float(np.sum(norms**2 * tt - 2 * norms * s * dot + s**2 * cc) / in_features)
        packed.append(pack(idx, bits))
        scales.append(s.astype(np.float32))
    return (
        mx.array(np.concatenate(packed)),
        mx.array(np.concatenate(scales)),
        mx.array((levels / root).astype(np.float32)),
        error,
    )


def check_group_size(group_size, in_features):
    if group_size is None:
        return
    if not isinstance(group_size, int) or group_size < 1 or in_features % group_size:
        raise ValueError(f"group size {group_size!r} must be a positive integer dividing in_features {in_features}")


def _quantize_grouped(weight, bits, rotation, group_size, hessian, damp, pool):
    """Group scales and/or GPTQ; returns a function giving quantize_weight's tuple. Here, on the
    calling thread: the MLX part (the rotated weight, the factors of H); on ``pool``: GPTQ, refit,
    packing and error of row chunks (rows are independent: the bytes do not depend on the chunks)."""
    out_features, in_features = weight.shape
    check_group_size(group_size, in_features)
    levels = codebook(bits, in_features)
    root = math.sqrt(in_features)
    unit = (levels / root).astype(np.float32)  # the stored codebook: code values per unit step*root
    h = n = None  # no moments: round to nearest with the same scales
    if hessian is not None:
        h, n = _rotated_factors(hessian, rotation, gptq.DAMP if damp is None else damp)
    levels = levels.astype(np.float32)
    jobs = []
    for a, b in gptq._chunks(out_features, _job_rows(out_features)):
        # Each job's rows rotated on their own (a row's rotation does not depend on the others),
        # so the pool starts on the first job while MLX rotates the next: the 151,936-row head's
        # rotation had left a core idle for ~2 s. The GIL is released while MLX computes.
        w = rotation.apply(weight[a:b].astype(mx.float32))
        mx.eval(w)
        # MLX's buffer, no copy (the job only reads it)
        jobs.append(pool.submit(_quantize_rows, np.asarray(w), n, levels, unit, group_size, h, bits))

    def finish():
        parts = [job.result() for job in jobs]
        s = np.concatenate([p[0] for p in parts])
        if group_size is None:
            scales = s[:, 0].astype(np.float32)
        else:
            if any(p[1] is None for p in parts):
                raise ValueError("a group scale overflows float16; quantize this layer without --group-size")
            scales = s.astype(np.float16)
        packed = np.concatenate([p[1] for p in parts])
        error = float(np.sum(np.concatenate([p[2] for p in parts])))
        return mx.array(packed), mx.array(scales), mx.array(unit), error

    return finish


def _job_rows(rows):
    """Rows per pool job: _ROW_CHUNK bounds the temporaries (no 545 MB code array for a 151,936-row
    head; packing in cache: 1.6-2.1 -> 0.55 CPU-s for it); a layer is split in _JOB_PARTS so two
    threads each get a part, but not below 1024 rows: the GPTQ column loop is numpy calls on
    vectors of a part's rows, and numpy holds the GIL through an element-wise loop of 500 elements
    or fewer (the threads would take turns). A 896-row layer stays one job; the other layers of
    its block run beside it. The split must not depend on the thread count: OpenBLAS's Haswell
    kernels (used on AMD family 26, 2026-12-03) give products that depend on the matrix's width,
    so a different split is a different rounding; one split makes every thread count give the
    same bytes."""
    return min(_ROW_CHUNK, max(1024, -(-rows // _JOB_PARTS)))


def _quantize_rows(w, n, levels, unit, group_size, h, bits):
    """Codes, refit steps, packed words and squared error per row of a row chunk (numpy only: it
    runs on a pool thread). Returns (steps [rows, groups], packed or None where a step overflows
    float16, error per row float64)."""
    idx, _ = gptq.gptq(w, n, levels, group_size)
    c = unit[idx]  # code values, for the refit and the error
    s = gptq.refit_steps(w, c, group_size, h)
    if group_size is None:
        scales = s[:, 0].astype(np.float32)
    elif np.all(np.abs(s) < 65504):
        scales = s.astype(np.float16)
    else:
        return s, None, None
    return s, pack(idx, bits), _squared_error(w, c, scales, group_size)


def _squared_error(w, c, scales, group_size):
    """||w_o - s_o * c_o||^2 per row o (float64; ``c`` the code values of a job's rows, at most
    _ROW_CHUNK). Per row, so the total does not depend on how the rows were split into jobs."""
    rows, d = w.shape
    s = scales.astype(np.float32)
    if group_size is None:
        e = w - c * s[:, None]
    else:  # the steps broadcast over their groups (no repeated [rows, d] copy of them)
        e = (w.reshape(rows, -1, group_size) - c.reshape(rows, -1, group_size) * s[:, :, None]).reshape(rows, d)
    return np.einsum("ij,ij->i", e, e, dtype=np.float64)


_FACTORS = []  # [(hessian, rotation state key, (h, u))]: the last few (a block's distinct inputs)
_KEEP = 4


def _rotated_factors(hessian, rotation, damp):
    """(damped H_r, N) for GPTQ (gptq.ldl_factor). Linears that read one activation with one
    rotation (q/k/v or gate/up sharing a rotation) pass the same H object: factorised once."""
    key = (rotation.kind, rotation.dim, rotation.seed, damp)
    for h_, key_, factors in _FACTORS:  # named_modules order is up, down, gate, ...: not adjacent
        if h_ is hessian and key_ == key:
            return factors
    h = np.array(gptq.rotate_hessian(hessian, rotation), dtype=np.float32)
    n = gptq.ldl_factor(h, damp)
    # The scale refit minimises the same damped objective GPTQ did (a ridge towards plain least
    # squares, so a few calibration tokens cannot pull a scale far off). In place on the diagonal:
    # adding damp * mean * I densely cost two d x d temporaries for the same float32 sums.
    np.fill_diagonal(h, h.diagonal() + np.float32(damp * max(float(np.mean(np.diag(h))), 1e-30)))
    _FACTORS[:] = [(hessian, key, (h, n))] + _FACTORS[: _KEEP - 1]
    return h, n


def expand_scales(scales, group_size, in_features):
    """Scales broadcastable against C[q] (rows x in_features): per row [n] -> [n, 1]; per group
    [n, in // group_size] -> [n, in] (group g covers rotated inputs [g * group_size, (g + 1) * group_size))."""
    if scales.ndim == 1:
        return scales[:, None]
    return mx.repeat(scales, group_size, axis=-1)[..., :in_features]


def dense_weight(module, dtype):
    """The full-precision weight of a Linear/Embedding, dequantizing affine-quantized layers."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(
            module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
            mode=getattr(module, "mode", "affine"),
        )
        return w.astype(dtype)
    return module.weight.astype(dtype)


class QuantizedLinear(nn.Module):
    group_size = None  # None: one scale per row; else scales [out, in // group_size] (rotated index)
    codes = "scalar"  # or "trellis": then ``trellis`` is (L, code scale)
    trellis = None

    def __init__(self, in_features, out_features, bits, rotation, packed, scales, codebook, bias=None,
                 group_size=None, trellis=None):
        super().__init__()
        if trellis is not None:
            self.codes = "trellis"
            object.__setattr__(self, "trellis", (int(trellis[0]), float(trellis[1])))  # not a parameter tree
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = None if group_size is None else int(group_size)
        self.rotation = rotation
        self.packed = packed
        self.scales = scales
        self.codebook = codebook
        if bias is not None:
            self.bias = bias
        self.freeze()

    @classmethod
    def from_linear(cls, linear, bits, rotation="auto", seed=0, weight=None, group_size=None, hessian=None,
                    damp=None, pool=None, codes="scalar"):
        """Quantize an ``nn.Linear`` (or a dequantized ``weight`` of another layer); ``hessian`` is
        the input second moments X^T X (in x in) from calibration, for GPTQ. With ``pool``
        (vqpipe/parallel.py) the numpy work runs there and this returns a function that gives
        the layer (call it on the thread that uses MLX). ``codes`` "trellis": trellis codes
        (the caller checks :func:`trellis_fits`)."""
        weight = linear.weight if weight is None else weight
        out_features, in_features = weight.shape
        r = rotation if isinstance(rotation, rot.Rotation) else rot.make_rotation(rotation, in_features, seed)
        tr = None
        if codes == "trellis":
            if not trellis_fits(bits, out_features, in_features, group_size):
                raise ValueError(f"a ({out_features}, {in_features}) layer at {bits} bits (group size {group_size}) "
                                 "cannot take trellis codes")
            tr = (trellis.L_DEFAULT, trellis.SCALE)
            pending = quantize_trellis(weight, bits, r, hessian, damp, pool)
        elif codes != "scalar":
            raise ValueError(f"unknown codes {codes!r}; choose one of {', '.join(CODES)}")
        else:
            pending = quantize_weight(weight, bits, r, group_size, hessian, damp, pool)
        bias = linear.get("bias") if isinstance(linear, nn.Module) else None

        def layer():
            packed, scales, levels, error = pending() if pool is not None else pending
            new = cls(in_features, out_features, bits, r, packed, scales, levels, bias, group_size, tr)
            new.squared_error = error
            return new

        return layer if pool is not None else layer()

    def dequantized_weight(self, dtype=mx.float32):
        """W_hat (out x in) in the original basis: (s * C[q]) R. For analysis, not the forward."""
        if self.trellis is not None:
            return self.rotation.apply_transpose(self.trellis_values(dtype)) * self.scales.astype(dtype)[:, None]
        w = dequant.codes_to_values(self.packed, self.codebook, self.bits, self.in_features, dtype)
        s = expand_scales(self.scales.astype(dtype), self.group_size, self.in_features)
        if self.scales.ndim == 1:  # per row: scaling commutes with R
            return self.rotation.apply_transpose(w) * s
        return self.rotation.apply_transpose(w * s)

    def trellis_values(self, dtype=mx.float32):
        """A trellis layer's code values [out, in] in the rotated basis (no scales)."""
        return dequant.trellis_values(self.packed, self.codebook, self.bits, self.out_features, self.in_features,
                                      self.trellis[0], dtype, self.trellis[1])

    def rotated_weight(self, dtype):
        """C[q] in the rotated basis; with group scales already multiplied in (per-row scales are
        applied to the output instead)."""
        if self.trellis is not None:
            return self.trellis_values(dtype)
        w = self.codebook.astype(dtype)[unpack(self.packed, self.bits, self.in_features)]
        if self.group_size is None:
            return w
        rows, g = self.out_features, self.in_features // self.group_size
        w = w.reshape(rows, g, self.group_size) * self.scales.astype(dtype)[:, :, None]
        return w.reshape(rows, self.in_features)

    def __call__(self, x):
        fused = self.__dict__.get("_fused")  # siblings computed as one (vqpipe/layers/fused.py)
        if fused is not None:
            return fused(self, x)
        return self.forward(x, self.rotation)

    def forward(self, x, rotation):
        """y for ``x`` rotated by ``rotation`` (the layer's own, or vqpipe/layers/fold.py's copy of it
        without the signs, for an ``x`` that carries them already)."""
        if self.trellis is not None:
            return trellis_forward(x, rotation, self["packed"], self["scales"], self["codebook"], self.bits,
                                   self.trellis, self.get("bias"))
        # Decode (a few rows of x) on a GPU: the fused mat-vec reads the packed weights once
        # (vqpipe/kernels/qmv.py); on the CPU the compiled one (vqpipe/kernels/ext.py). Deterministic, but not
        # bit-identical to the dense path below, which runs for prefill and where neither does.
        # (the kernel covers qmv.BITS; a layer of a mixed allocation at 5 or 6 bits runs dense)
        dialect = qmv.dispatch(x) if self.bits in qmv.BITS else None
        if dialect is not None:
            # self[...]: nn.Module's attribute lookup costs ~0.4 us a time, and this runs per layer per token
            # the kernel rotates x in its prologue where it can (else MLX ops rotate it first)
            return dispatch.launch(
                dialect, x, self["packed"], self["scales"], self["codebook"], self.bits, self.get("bias"),
                self.group_size, rotation, owner=self,
            )
        if ext.dispatch(x):  # decode on the CPU: the compiled mat-vec, no dense weight (vqpipe/kernels/ext.py)
            return ext.matvec(rotation.apply(x), self["packed"], self["scales"], self["codebook"], self.bits,
                              self.get("bias"), self.group_size)
        return dense_forward(rotation.apply(x), self.packed, self.scales, self.codebook, self.bits,
                             self.get("bias"), self.group_size)

    def to_state(self):
        rmeta, rarrays = self.rotation.to_state()
        meta = {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bits": self.bits,
            "has_bias": "bias" in self,
            "rotation": rmeta,
        }
        if self.group_size is not None:  # absent = per-row scales (what older artifacts hold)
            meta["group_size"] = self.group_size
        if self.trellis is not None:  # absent = scalar codes
            meta["codes"] = trellis_meta(*self.trellis)
        arrays = {"packed": self.packed, "scales": self.scales, "codebook": self.codebook}
        if "bias" in self:
            arrays["bias"] = self.bias
        arrays.update({f"rotation.{k}": v for k, v in rarrays.items()})
        return meta, arrays

    @classmethod
    def from_state(cls, meta, arrays):
        """Rebuild from ``to_state`` output: no QR, no codebook fit, no nearest-centroid search."""
        rarrays = {k[len("rotation.") :]: v for k, v in arrays.items() if k.startswith("rotation.")}
        r = rot.from_state(meta["rotation"], rarrays)
        return cls(
            int(meta["in_features"]),
            int(meta["out_features"]),
            int(meta["bits"]),
            r,
            arrays["packed"],
            arrays["scales"],
            arrays["codebook"],
            arrays.get("bias") if meta.get("has_bias") else None,
            None if meta.get("group_size") is None else int(meta["group_size"]),
            trellis_params(meta),
        )

    def _extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"rotation={self.rotation.kind}" + (f", group_size={self.group_size}" if self.group_size else "")
            + (f", codes=trellis L={self.trellis[0]}" if self.trellis else "")
        )


class QuantizedEmbedding(QuantizedLinear):
    """An embedding table quantized like a linear layer (rows = tokens, rotation over hidden).

    Lookup dequantizes only the selected rows; ``as_linear`` serves tied output heads. The rows come
    out in ``out_dtype`` (the source embedding's dtype, so the residual stream has the dtype it has in
    the source) on a GPU, and in float32 on the CPU, where MLX's bf16/fp16 arithmetic is slow (README,
    "CPU BLAS"): the rest of the model then computes in float32 there whatever its stored dtypes.
    """

    out_dtype = mx.float32  # artifacts from before the dtype was recorded: the codebook's dtype
    # A tied head of a residual-rotated model reads head(x) (vqpipe/layers/head.py): a
    # plain attribute, stored in the layer's state as ``head.*``
    head = None

    @classmethod
    def from_embedding(cls, embedding, bits, rotation="auto", seed=0, weight=None):
        return cls.from_linear(embedding, bits, rotation, seed, weight=weight)

    def lookup_dtype(self):
        return mx.float32 if mx.default_device() == mx.cpu else self.out_dtype

    def __call__(self, ids):
        flat = ids.reshape(-1)
        if self.trellis is not None:
            return self._trellis_lookup(ids, flat)
        rows = dequant.codes_to_values(self.packed[flat], self.codebook, self.bits, self.in_features, self.codebook.dtype)
        if self.group_size is None:
            rows = self.rotation.apply_transpose(rows) * self.scales[flat][:, None]
        else:  # group scales live in the rotated basis: scale, then rotate back
            rows = self.rotation.apply_transpose(rows * expand_scales(self.scales[flat], self.group_size, self.in_features))
        rows = rows.reshape(*ids.shape, self.in_features)
        dt = self.lookup_dtype()
        return rows if rows.dtype == dt else rows.astype(dt)

    def _trellis_lookup(self, ids, flat):
        """Rows of a trellis table: each token's block of 32 rows decoded, its row taken."""
        block = self.packed[flat // trellis.TILE_ROWS]
        n = flat.shape[0]
        v = dequant.trellis_values(block, self.codebook, self.bits, n * trellis.TILE_ROWS, self.in_features,
                                   self.trellis[0], scale=self.trellis[1])
        rows = v.reshape(n, trellis.TILE_ROWS, -1)[mx.arange(n), flat % trellis.TILE_ROWS]
        rows = self.rotation.apply_transpose(rows) * self.scales[flat][:, None]
        rows = rows.reshape(*ids.shape, self.in_features)
        dt = self.lookup_dtype()
        return rows if rows.dtype == dt else rows.astype(dt)

    def to_state(self):
        meta, arrays = super().to_state()
        meta["dtype"] = str(self.out_dtype).rsplit(".", 1)[-1]
        if self.head is not None:
            hmeta, harrays = self.head.to_state()
            meta["head"] = hmeta
            arrays.update({f"head.{k}": v for k, v in harrays.items()})
        return meta, arrays

    @classmethod
    def from_state(cls, meta, arrays):
        layer = super().from_state(meta, {k: v for k, v in arrays.items() if not k.startswith("head.")})
        if "dtype" in meta:
            layer.out_dtype = getattr(mx, meta["dtype"])
        if "head" in meta:
            layer.head = Head.from_state(meta["head"], {k[len("head."):]: v for k, v in arrays.items()
                                                        if k.startswith("head.")})
        return layer

    def as_linear(self, x):
        return QuantizedLinear.__call__(self, x if self.head is None else self.head(x))


def trellis_forward(x, rotation, packed, scales, table, bits, params, bias=None):
    """y of a trellis layer (or fused group) for ``x``: the compiled mat-vec for decode on the CPU
    (the rule of ext.dispatch) or a CUDA GPU (ext.gpu_dispatch), on Metal its kernel there
    (vqpipe/kernels/trellis_metal.py, untested), else the dense reconstruction (vqpipe/kernels/dequant.py)."""
    xr = rotation.apply(x)
    if ext.dispatch(x) or ext.gpu_dispatch(x):
        return ext.trellis_matvec(xr, packed, scales, bits, params[0], params[1], bias)
    if trellis_metal.dispatch(x):
        return trellis_metal.matvec(xr, packed, scales, bits, params[0], params[1], bias)
    return dequant.trellis_forward(xr, packed, scales, table, bits, params[0], bias, params[1])


def trellis_meta(L, scale):
    """A trellis layer's ``codes`` header entry (docs/reservoir-format.md)."""
    return {"kind": "trellis", "L": L, "code": "1mad", "scale": scale, "tile": [trellis.TILE_ROWS, trellis.GROUP]}


def trellis_params(meta):
    """(L, code scale) of a stored layer's meta, None for scalar codes."""
    codes = meta.get("codes")
    if codes is None:
        return None
    if codes.get("kind") != "trellis" or codes.get("code") != "1mad" or codes.get("tile") != [trellis.TILE_ROWS, trellis.GROUP]:
        raise ValueError(f"unknown codes {codes!r}: this vqpipe decodes 1mad trellis codes in tiles of "
                         f"{trellis.TILE_ROWS} x {trellis.GROUP}")
    return int(codes["L"]), float(codes["scale"])
