"""A compiled greedy decode step over packed KIVI caches (``mx.compile`` over the whole model step).

Eager decode rebuilds the step's graph in Python for every token; for the packed cache that is,
per layer, the cache update, the launch's arguments and MLX's custom-kernel call (29.5 us of host
dispatch per layer at 8k on the H200, against 1.3-3.3 for fp16 SDPA: docs/kivi.md). ``mx.compile``
traces the step once and replays it, but reuses a trace only while the inputs keep their shapes
and nothing the trace read from Python changes. The packed cache changes in two ways:

- every step: one token into the residual buffer at position ``nres``, and the counts the kernel
  reads. In the compiled step both are arrays (the token goes in with ``mx.slice_update`` at an
  array index, the counts are the kernel's 8-byte input), so the trace holds;
- every ``group_size`` steps: a flush (quantize the oldest residual group into the codes). That
  step runs eagerly, through the cache itself, as do steps whose write would not fit the residual
  buffer. The code buffers grow every 256 tokens: a new shape, so ``mx.compile`` traces again.

The kernel's split count is fixed at trace time from the quantized tokens then; the kernel divides
the chunks among the splits from the counts at run time, so a trace reused after a flush is exact
(the splits only change the order of float32 sums). Without a GPU, attention takes the tile path
over the whole residual buffer under a mask of the valid tokens, and the trace is keyed by the
quantized count too (the tile loop is Python).
"""

import mlx.core as mx

from . import decode_kernel
from .store import PackedKIVICache

PER_LAYER = 8  # kc, kp, vc, vp, rk, rv, scratch, counters


class StepView(PackedKIVICache):
    """One layer's packed cache inside the compiled step: its buffers are the step's inputs, the
    offset an array (rope takes one), the new token written at an array index, no flush."""

    def __init__(self, cache, bufs, pos, counts, index, valid):
        self.kv_bits, self.group_size, self.residual_length = cache.kv_bits, cache.group_size, cache.residual_length
        self.use_kernels = cache.use_kernels
        self.kc, self.kp, self.vc, self.vp, self._rk, self._rv, *scratch = bufs
        self.scratch = tuple(scratch)
        self.quantized, self.flushes = cache.quantized, cache.flushes
        # a Python count for the launch's split choice only (the kernel reads ``counts``)
        self.nres = cache.nres + 1
        self.offset, self.step_counts, self.index, self.valid = pos, counts, index, valid
        self.last_out = self.launch_memo = None

    def update_and_fetch(self, keys, values):
        self._rk = mx.slice_update(self._rk, keys, self.index, axes=(2,))
        self._rv = mx.slice_update(self._rv, values, self.index, axes=(2,))
        return self, self

    def residual(self):
        return self._rk, self._rv

    def residual_mask(self):
        return self.valid

    def make_mask(self, n, return_array=False, window_size=None):
        if n != 1 or window_size is not None:
            raise ValueError("the compiled KIVI step takes one token and full attention")
        return None


class KIVIDecoder:
    """Greedy decode of ``model`` over its packed KIVI caches ``caches`` (one per layer, filled by
    prefill), one token per :meth:`step`, the step compiled (see the module docstring)."""

    def __init__(self, model, caches):
        if not caches or not all(type(c) is PackedKIVICache for c in caches):
            raise ValueError("the compiled KIVI step needs one PackedKIVICache per layer (make_kivi_cache(..., packed=True))")
        if len({(c.offset, c.quantized, c.nres, c.kv_bits, c.group_size, c.residual_length) for c in caches}) != 1:
            raise ValueError("the compiled KIVI step needs every layer's cache at the same position and settings")
        self.model, self.caches = model, caches
        self._fns = {}
        self._none = mx.zeros((1, 1), mx.bool_)
        self.traces = self.eager_steps = self.compiled_steps = 0

    def _kernel(self):
        c = self.caches[0]
        return decode_kernel.active(c.use_kernels)

    def _eager(self, token):
        self.eager_steps += 1
        return self.model(token, cache=self.caches)[:, -1, :]

    def _trace(self, token, pos, counts, index, valid, *bufs):
        self.traces += 1
        views = [StepView(c, bufs[PER_LAYER * j : PER_LAYER * (j + 1)], pos, counts, index, valid)
                 for j, c in enumerate(self.caches)]
        logits = self.model(token, cache=views)[:, -1, :]
        return [logits] + [x for v in views for x in (v._rk, v._rv)]

    def _ready(self):
        """Scratch for the most splits a launch may take, so no launch reallocates it in a trace."""
        c = self.caches[0]
        rk = c.residual_buffers()[0]
        b, h, _, d = rk.shape
        for c in self.caches:
            if c.scratch is None or c.scratch[0].shape[1] < decode_kernel.NSMAX:
                q_heads = getattr(self.model.args, "num_attention_heads", h)
                r = q_heads // h
                c.scratch = (mx.zeros((b * h, decode_kernel.NSMAX, r * (d + 2)), mx.float32), mx.zeros((b * h,), mx.uint32))

    def step(self, token):
        """The logits [B, vocab] after ``token`` [B, 1] (int), every cache advanced by one token."""
        c0 = self.caches[0]
        rk = c0.residual_buffers()[0]
        flush_due = (c0.nres + 1 - c0.residual_length) // c0.group_size > 0
        if c0.offset + 1 >= 2**24:
            raise ValueError("decode attention passes token counts as float32: at most 2**24 tokens")
        if rk is None or c0.kc is None or flush_due or c0.nres + 1 > rk.shape[2]:
            return self._eager(token)
        kernel = self._kernel()
        if kernel:
            self._ready()
        key = None if kernel else c0.quantized
        if key not in self._fns:
            self._fns[key] = mx.compile(self._trace)
        pos = mx.array(c0.offset, mx.int32)
        counts = mx.array([c0.quantized, c0.nres + 1], mx.float32)
        index = mx.array([c0.nres], mx.int32)
        # the valid residual tokens, for the tile path only (the kernel reads the counts)
        valid = self._none if kernel else (mx.arange(rk.shape[2]) <= c0.nres)[None]
        bufs = []
        for c in self.caches:
            bufs += [c.kc, c.kp, c.vc, c.vp, c._rk, c._rv, *(c.scratch or (mx.zeros((1,)), mx.zeros((1,), mx.uint32)))]
        logits, *res = self._fns[key](token, pos, counts, index, valid, *bufs)
        for j, c in enumerate(self.caches):
            c._rk, c._rv = res[2 * j], res[2 * j + 1]
            c.nres += 1
            c.offset += 1
            c.last_out = None
        self.compiled_steps += 1
        return logits

    def greedy(self, token):
        """The greedy next token [B, 1] after ``token``."""
        return mx.argmax(self.step(token), axis=-1).astype(token.dtype).reshape(token.shape[0], 1)


def stream(model, caches, prompt, max_tokens, prefill_step=2048):
    """Greedy ids one by one (for streaming): every prompt token but the last through the eager
    model in chunks (as mlx-lm prefills), then :class:`KIVIDecoder` steps, step i + 1 queued before
    token i is read. ``caches``: fresh packed caches (``make_kivi_cache(..., packed=True)``)."""
    prompt = mx.array(prompt)
    n = int(prompt.size)
    if n < 1:
        raise ValueError("compiled KIVI decode: empty prompt")
    for a in range(0, n - 1, prefill_step):
        model(prompt[None, a : min(a + prefill_step, n - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    dec = KIVIDecoder(model, caches)
    token = prompt[None, n - 1 :].astype(mx.int32)
    token = dec.greedy(token)
    for i in range(max_tokens):
        nxt = None
        if i + 1 < max_tokens:
            nxt = dec.greedy(token)
            mx.async_eval(nxt)
        yield int(token.item())
        token = nxt
