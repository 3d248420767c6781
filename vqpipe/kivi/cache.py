"""KIVI KV cache for mlx-lm: keys quantized per channel, values per token, newest tokens kept exact.

Layout and schedule: tokens ``[0, quantized)`` have been through quantize-then-dequantize, tokens
``[quantized, offset)`` are the full-precision residual. Whenever the residual reaches
``residual_length + group_size`` tokens, its oldest ``group_size`` tokens are flushed (repeatedly,
so a 2048-token prefill chunk flushes all whole groups beyond the newest ``residual_length`` in one
launch). Flushes happen inside ``update_and_fetch``, before attention reads the cache, as in the
KIVI paper's decoding step.

The store is full-precision resident (as in the original experiment): ``nbytes`` is what is
allocated (the buffers and a copy of the residual tokens); ``compressed_nbytes`` is what a packed
store would take (codes + fp16 scale/zero per group + the full-precision residual). The two are
never mixed.
"""

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask, make_prompt_cache

from . import kernels, quantizer
from .attention import packed_problem
from .store import PackedKIVICache


class KIVICache(_BaseCache):
    step = 256
    # Defaults so that _BaseCache.from_state (which skips __init__) yields a usable cache.
    # The attribute is kv_bits, not bits: mlx-lm routes any cache with `.bits` to quantized SDPA.
    kv_bits = 4
    group_size = 32
    residual_length = 128
    use_kernels = None
    keys = None
    values = None
    _rk = ()
    _rv = ()
    offset = 0
    quantized = 0
    flushes = 0

    def __init__(self, bits=4, group_size=32, residual_length=128, use_kernels=None):
        quantizer._qmax(bits)
        if group_size < 1 or residual_length < 0:
            raise ValueError("group_size must be >= 1 and residual_length >= 0")
        self.kv_bits = int(bits)
        self.group_size = int(group_size)
        self.residual_length = int(residual_length)
        self.use_kernels = use_kernels
        self.keys = None
        self.values = None
        self._rk = []  # the residual tokens [quantized, offset) as the chunks that brought them
        self._rv = []
        self.offset = 0
        self.quantized = 0  # tokens [0, quantized) hold dequantized values
        self.flushes = 0  # groups of group_size tokens flushed so far

    def _grow(self, keys, values):
        prev, n = self.offset, keys.shape[2]
        if self.keys is not None and prev + n <= self.keys.shape[2]:
            return
        b, h, _, dk = keys.shape
        steps = (self.step + n - 1) // self.step * self.step
        new_k = mx.zeros((b, h, steps, dk), keys.dtype)
        new_v = mx.zeros((b, h, steps, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
            self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)

    def _residual(self):
        """The residual tokens [quantized, offset) as one (keys, values) pair."""
        if len(self._rk) > 1:
            self._rk = [mx.concatenate(self._rk, axis=2)]
            self._rv = [mx.concatenate(self._rv, axis=2)]
        return self._rk[0], self._rv[0]

    def update_and_fetch(self, keys, values):
        self._grow(keys, values)
        prev = self.offset
        self.offset += keys.shape[2]
        self._rk.append(keys)
        self._rv.append(values)
        if len(self._rk) > 64:  # a long residual (large residual_length) in one piece, not per token
            self._residual()
        g = self.group_size
        due = (self.offset - self.quantized - self.residual_length) // g
        if due <= 0:
            self.keys[..., prev : self.offset, :] = keys
            self.values[..., prev : self.offset, :] = values
        else:
            # Flush the oldest due*g residual tokens. The quantizer reads the residual chunks, never
            # a view of self.keys: a live view of the buffer makes MLX copy the whole buffer instead
            # of updating it in place. Flushed and residual tokens go in with one slice update.
            m, a = due * g, self.quantized
            rk, rv = self._residual()
            # x_hat only: the store is quantize-dequantize, so scale and zero are never kept
            kh, vh = kernels.fake_quant_kv_hat(rk[..., :m, :], rv[..., :m, :], self.kv_bits, g, self.use_kernels)
            self._rk, self._rv = [rk[..., m:, :]], [rv[..., m:, :]]
            self.keys[..., a : self.offset, :] = mx.concatenate([kh, self._rk[0]], axis=2)
            self.values[..., a : self.offset, :] = mx.concatenate([vh, self._rv[0]], axis=2)
            self.quantized += m
            self.flushes += due
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def size(self):
        return self.offset

    def empty(self):
        return self.keys is None

    @property
    def state(self):
        if self.keys is None:
            return []
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, v):
        if not v:
            self.keys = self.values = None
            self.offset = 0
        else:
            self.keys, self.values = v
            self.offset = self.keys.shape[2]
        self._sync_residual()

    def _sync_residual(self):
        self.quantized = min(self.quantized, self.offset)
        if self.keys is None:
            self._rk, self._rv = [], []
        else:
            self._rk = [self.keys[..., self.quantized : self.offset, :]]
            self._rv = [self.values[..., self.quantized : self.offset, :]]

    @property
    def meta_state(self):
        return tuple(
            str(x)
            for x in (self.kv_bits, self.group_size, self.residual_length, self.quantized, self.flushes)
        )

    @meta_state.setter
    def meta_state(self, v):
        self.kv_bits, self.group_size, self.residual_length, self.quantized, self.flushes = map(int, v)
        self._sync_residual()

    def is_trimmable(self):
        return True

    def trim(self, n):
        # Trimmed-into groups stay quantized (with their original scale/zero); later flushes start
        # at the new boundary.
        n = min(self.offset, n)
        self.offset -= n
        keep = max(self.offset - self.quantized, 0)
        self.quantized = min(self.quantized, self.offset)
        if self._rk:
            rk, rv = self._residual()
            self._rk, self._rv = [rk[..., :keep, :]], [rv[..., :keep, :]]
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self):
        """Resident bytes: the full-precision buffers plus the copy of the residual tokens."""
        if self.keys is None:
            return 0
        residual = self._residual_tokens_nbytes()
        return self.keys.nbytes + self.values.nbytes + residual

    def _tokens_nbytes(self, n):
        """n tokens of keys and values at the cache dtype."""
        b, h, _, dk = self.keys.shape
        return b * h * n * (dk * self.keys.itemsize + self.values.shape[3] * self.values.itemsize)

    def _residual_tokens_nbytes(self):
        return self._tokens_nbytes(self.offset - self.quantized)

    @property
    def compressed_nbytes(self):
        """Bytes a packed KIVI store would take for the current tokens: bits per quantized
        element plus fp16 scale and zero per group, and the residual at the cache dtype.
        Computed, not allocated."""
        if self.keys is None:
            return 0
        b, h, _, dk = self.keys.shape
        dv = self.values.shape[3]
        g, nq = self.group_size, self.quantized
        k_groups = b * h * -(-nq // g) * dk
        v_groups = b * h * nq * -(-dv // g)
        packed = quantizer.packed_nbytes(b * h * nq * dk, k_groups, self.kv_bits)
        packed += quantizer.packed_nbytes(b * h * nq * dv, v_groups, self.kv_bits)
        return packed + self._residual_tokens_nbytes()

    def stats(self):
        """Token counts and sizes, each labelled: resident vs compressed vs uncompressed."""
        full = 0 if self.keys is None else self._tokens_nbytes(self.offset)
        return {
            "offset": self.offset,
            "quantized_tokens": self.quantized,
            "residual_tokens": self.offset - self.quantized,
            "flushes": self.flushes,
            "resident_nbytes": self.nbytes,
            "compressed_nbytes": self.compressed_nbytes,
            "uncompressed_nbytes": full,
        }


def make_kivi_cache(model, bits=4, group_size=32, residual_length=128, use_kernels=None, packed=True):
    """One cache per layer, as ``mlx_lm.models.cache.make_prompt_cache`` would build, with every
    plain ``KVCache`` replaced by a KIVI cache (sliding-window and state-space caches stay).

    ``packed=True`` (default): :class:`vqpipe.kivi.store.PackedKIVICache`, codes resident and
    attention that reads them (the memory saving); the model's attention is routed to it
    (:func:`vqpipe.kivi.attention.install`). ``packed=False``: :class:`KIVICache`, the definition
    (quantize-dequantize, full-precision values resident: more memory than the fp16 cache), kept
    as the reference the packed cache is tested against."""
    caches = make_prompt_cache(model)
    if packed:
        why = packed_problem(model)  # installs the route
        if why:
            raise ValueError(why)
        make = PackedKIVICache
    else:
        make = KIVICache
    return [make(bits, group_size, residual_length, use_kernels) if type(c) is KVCache else c for c in caches]


def cache_stats(caches):
    """Totals over the KIVI caches of a prompt cache: sizes and flushes summed over layers, token
    counts from the first layer (every layer sees the same tokens)."""
    layers = [c.stats() for c in caches if hasattr(c, "kv_bits") and hasattr(c, "stats")]
    if not layers:
        return {}
    total = dict(layers[0])
    for key in ("flushes", "resident_nbytes", "compressed_nbytes", "uncompressed_nbytes"):
        total[key] = sum(s[key] for s in layers)
    total["layers"] = len(layers)
    return total
