"""Packed KIVI cache: the quantized tokens kept as packed codes, attention reads the codes.

Same quantizer, flush schedule and semantics as :class:`vqpipe.kivi.cache.KIVICache` (the
definition): tokens ``[0, quantized)`` are quantized (keys per channel, values per token), the
newest ``[quantized, offset)`` stay full precision, and whenever the residual reaches
``residual_length + group_size`` tokens every whole group beyond the newest ``residual_length`` is
flushed. The difference is storage: codes in uint32 words and a float16 scale and zero per group
(:mod:`vqpipe.kivi.bitpack`), no full-precision copy of the quantized tokens anywhere. Attention
goes through :func:`vqpipe.kivi.attention.attend` (mlx-lm's ``scaled_dot_product_attention`` is
routed there for this cache by :func:`vqpipe.kivi.attention.install`, which ``make_kivi_cache``
calls).

``nbytes`` is what is allocated: the code and parameter buffers (grown ``step`` tokens at a time)
and the residual. The state round-trips through mlx-lm's ``save_prompt_cache`` /
``load_prompt_cache`` (the class is registered in ``mlx_lm.models.cache``, where the loader looks
classes up by name).
"""

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from . import bitpack


class PackedKIVICache(_BaseCache):
    step = 256  # tokens of code capacity added at a time (a multiple of group_size)
    # Defaults for _BaseCache.from_state, which skips __init__. `kv_bits`, not `bits`: mlx-lm routes
    # any cache with `.bits` to its own quantized attention.
    kv_bits = 4
    group_size = 32
    residual_length = 128
    use_kernels = None
    kc = kp = vc = vp = None
    _rk = _rv = None
    scratch = None
    last_out = None
    launch_memo = None
    # The decode launch's counts (quantized, residual) as a float32 [2] array when the cache is a
    # compiled step's view of itself (vqpipe/kivi/compiled.py); None: made per launch from the ints.
    step_counts = None
    nres = 0
    offset = 0
    quantized = 0
    flushes = 0

    def __init__(self, bits=4, group_size=32, residual_length=128, use_kernels=None):
        if bits not in (2, 4, 8):
            raise ValueError(f"packed KIVI stores 2, 4 or 8 bits per code, got {bits}")
        if group_size < 1 or residual_length < 0:
            raise ValueError("group_size must be >= 1 and residual_length >= 0")
        self.kv_bits, self.group_size, self.residual_length = int(bits), int(group_size), int(residual_length)
        self.use_kernels = use_kernels
        self.kc = self.kp = self.vc = self.vp = None
        self._rk = self._rv = None
        self.nres = self.offset = self.quantized = self.flushes = 0
        self.scratch = None  # the decode kernel's per-cache work buffers (decode_kernel.py)
        self.last_out = None  # its last output, which orders the next launch after it
        self.launch_memo = None  # the decode launch's keywords, reused while they hold

    # --- storage ---------------------------------------------------------------------------
    # The residual lives in a buffer of capacity >= R + G, the newest tokens written in place
    # (one slice update per step, as mlx-lm's KVCache does), so the decode kernel reads it whole
    # without a copy; a flush rebuilds it from the tokens that stay.

    def _grow(self, need):
        """Capacity for at least ``need`` quantized tokens (the buffers' old contents kept)."""
        have = 0 if self.vc is None else self.vc.shape[2]
        if need <= have:
            return
        g = self.group_size
        step = -(-self.step // g) * g
        add = -(-(need - have) // step) * step
        b, h, _, d = self._rk.shape
        w = d * self.kv_bits // 32
        ngv = -(-d // g)
        new = (
            mx.zeros((b, h, add // g, w, g), mx.uint32),
            mx.zeros((b, h, add // g, d, 2), mx.float16),
            mx.zeros((b, h, add, w), mx.uint32),
            mx.zeros((b, h, add, ngv, 2), mx.float16),
        )
        if self.vc is None:
            self.kc, self.kp, self.vc, self.vp = new
        else:
            old = (self.kc, self.kp, self.vc, self.vp)
            self.kc, self.kp, self.vc, self.vp = (mx.concatenate([o, n], axis=2) for o, n in zip(old, new))

    def _set_residual(self, k, v):
        """A fresh residual buffer holding the tokens k, v [B, H, n, D] first."""
        n = k.shape[2]
        cap = max(n, self.residual_length + self.group_size)
        if cap > n:
            pad = [(0, 0), (0, 0), (0, cap - n), (0, 0)]
            k, v = mx.pad(k, pad), mx.pad(v, pad)
        self._rk, self._rv, self.nres = k, v, n

    def residual(self):
        """The full-precision tokens [quantized, offset) as (keys, values) [B, H, n, D], or None."""
        if self._rk is None:
            return None
        return self._rk[..., : self.nres, :], self._rv[..., : self.nres, :]

    def residual_mask(self):
        """Which of :meth:`residual`'s tokens count (a bool [1, n] array), or None: all of them."""
        return None

    def residual_buffers(self):
        """(keys, values, n): the residual buffers whole and how many tokens they hold."""
        return self._rk, self._rv, self.nres

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        if self._rk is None:
            bitpack.check_geometry(keys.shape[-1], self.kv_bits, self.group_size)
            bitpack.check_geometry(values.shape[-1], self.kv_bits, self.group_size)
            self._set_residual(keys, values)
        elif self.nres + n > self._rk.shape[2]:
            rk, rv = self.residual()
            self._set_residual(mx.concatenate([rk, keys], axis=2), mx.concatenate([rv, values], axis=2))
        else:
            self._rk[..., self.nres : self.nres + n, :] = keys
            self._rv[..., self.nres : self.nres + n, :] = values
            self.nres += n
        self.offset += n
        g = self.group_size
        due = (self.nres - self.residual_length) // g
        if due > 0:
            self._flush(due * g)
            self.flushes += due
        # mlx-lm passes these to scaled_dot_product_attention, which install() routes to attend()
        # for this cache: the cache itself, nothing full precision is fetched.
        return self, self

    def _flush(self, m):
        """Quantize the oldest m residual tokens (whole groups) into the packed buffers."""
        a, g = self.quantized, self.group_size
        rk, rv = self.residual()
        self._grow(a + m)
        kc, kp, vc, vp = bitpack.quantize_flush(rk[..., :m, :], rv[..., :m, :], self.kv_bits, g)
        self.kc[:, :, a // g : (a + m) // g] = kc
        self.kp[:, :, a // g : (a + m) // g] = kp
        self.vc[:, :, a : a + m] = vc
        self.vp[:, :, a : a + m] = vp
        self._set_residual(rk[..., m:, :], rv[..., m:, :])
        self.quantized += m

    # --- views for attention --------------------------------------------------------------

    def dequantized(self, start, stop, dtype=mx.float32):
        """Keys and values of quantized tokens [start, stop) (multiples of group_size) in float32:
        one tile, as the prefill path reads it."""
        g, bits = self.group_size, self.kv_bits
        k = bitpack.dequantize_keys(self.kc[:, :, start // g : stop // g], self.kp[:, :, start // g : stop // g], bits, g)
        v = bitpack.dequantize_values(self.vc[:, :, start:stop], self.vp[:, :, start:stop], bits, g)
        return k.astype(dtype), v.astype(dtype)

    # --- mlx-lm cache interface -----------------------------------------------------------

    def size(self):
        return self.offset

    def empty(self):
        return self._rk is None

    @property
    def state(self):
        """Used parts of the buffers, the residual, and the counters (mlx-lm's prompt-cache file
        stores only ``state``, so the settings travel in it too)."""
        if self.empty():
            return []
        q, g = self.quantized, self.group_size
        rk, rv = self.residual()
        bufs = (self.kc, self.kp, self.vc, self.vp)
        if self.kc is None:
            bufs = (mx.zeros((0,), mx.uint32),) * 4
        else:
            bufs = (self.kc[:, :, : q // g], self.kp[:, :, : q // g], self.vc[:, :, :q], self.vp[:, :, :q])
        meta = [self.kv_bits, self.group_size, self.residual_length, self.offset, self.quantized, self.flushes]
        return [*bufs, rk, rv, *meta]

    @state.setter
    def state(self, v):
        self.scratch = self.last_out = self.launch_memo = None
        if not v:
            self.kc = self.kp = self.vc = self.vp = self._rk = self._rv = None
            self.nres = self.offset = self.quantized = self.flushes = 0
            return
        kc, kp, vc, vp, rk, rv, *meta = v
        self.kv_bits, self.group_size, self.residual_length, self.offset, self.quantized, self.flushes = map(int, meta)
        self.kc, self.kp, self.vc, self.vp = (None,) * 4 if self.quantized == 0 else (kc, kp, vc, vp)
        self._set_residual(rk, rv)
        if rk.shape[2] != self.offset - self.quantized or (self.vc is not None and self.vc.shape[2] != self.quantized):
            raise ValueError("KIVI state: token counts and arrays disagree")

    @property
    def meta_state(self):
        return ()  # everything is in state

    @meta_state.setter
    def meta_state(self, v):
        if v:
            raise ValueError("PackedKIVICache keeps its settings in state, not meta_state")

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the newest n tokens. Within the residual this is exact. Trimming into the quantized
        part drops whole groups and moves the kept tokens of a cut group back to the residual as
        their dequantized values (cache dtype): those tokens are quantized a second time at the
        next flush, where :class:`KIVICache` keeps their first quantization."""
        n = min(self.offset, n)
        new = self.offset - n
        if self._rk is None:
            return 0
        rk, rv = self.residual()
        if new >= self.quantized:
            self.nres = new - self.quantized
        else:
            g = self.group_size
            cut = new // g * g
            k, v = self.dequantized(cut, cut + g, rk.dtype) if new > cut else (rk[..., :0, :], rv[..., :0, :])
            self._set_residual(k[..., : new - cut, :], v[..., : new - cut, :])
            self.quantized = cut
        self.offset = new
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self):
        """Resident bytes: code and parameter buffers as allocated, plus the residual."""
        bufs = [] if self.kc is None else [self.kc, self.kp, self.vc, self.vp]
        res = [] if self._rk is None else [self._rk, self._rv]
        return sum(b.nbytes for b in bufs + res)

    def packed_nbytes(self):
        """The theoretical size of the current tokens: ``bits`` per quantized code, a float16 scale
        and zero per group, the residual at its dtype."""
        if self.empty():
            return 0
        rk, rv = self.residual()
        b, h, _, d = rk.shape
        g, q = self.group_size, self.quantized
        codes = 2 * b * h * q * d * self.kv_bits // 8
        groups = b * h * (q // g) * d + b * h * q * -(-d // g)
        return codes + 4 * groups + rk.nbytes + rv.nbytes

    def stats(self):
        full = 0
        if not self.empty():
            rk, rv = self.residual()
            b, h = rk.shape[:2]
            full = b * h * self.offset * (rk.shape[3] * rk.itemsize + rv.shape[3] * rv.itemsize)
        return {
            "offset": self.offset,
            "quantized_tokens": self.quantized,
            "residual_tokens": self.offset - self.quantized,
            "flushes": self.flushes,
            "resident_nbytes": self.nbytes,
            "compressed_nbytes": self.packed_nbytes(),
            "uncompressed_nbytes": full,
            # the decode kernel's work buffers (one partial per split), not part of the store
            "scratch_nbytes": 0 if self.scratch is None else sum(a.nbytes for a in self.scratch),
        }


# load_prompt_cache rebuilds caches by class name from mlx_lm.models.cache's globals.
setattr(mlx_cache, PackedKIVICache.__name__, PackedKIVICache)
