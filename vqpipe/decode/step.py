"""A compiled single-token decode step over a static-shape KV cache, for mlx-lm models.

mlx-lm's eager decode rebuilds the whole step graph in Python on every token (500-700 MLX
primitives at Llama-3-8B shapes, 5-8 ms of host time on the H200: docs/decode.md), which bounds
decode there more than the weights' bytes do. ``mx.compile`` traces the step once and replays it
from C++, fusing elementwise chains, but it reuses a trace only while every input keeps its shape
and every Python value it saw stays the same. mlx-lm's ``KVCache`` breaks both: it grows its
buffers, slices them to the current length and keeps the position as a Python int. So here:

- :class:`StaticCache` keeps mlx-lm's cache interface (``offset``, ``update_and_fetch``,
  ``make_mask``) over buffers preallocated to a fixed ``capacity``. During prefill (eager, many
  tokens) its offset is a Python int and it behaves exactly as ``KVCache`` (same values, same
  slices). In the compiled step its offset is a 0-d int32 array: the new key/value go in with
  ``mx.put_along_axis`` at that array index (:func:`write_kv`), attention reads the whole buffer under a mask built
  from the position, and rope takes the array offset (``mx.fast.rope`` accepts one).
- :class:`Decoder` owns one compiled step per model: token, position and the cache buffers in;
  the greedy next token, the next position and the updated buffers out. Nothing crosses to the
  host between steps; the caller reads token i while step i + 1 is queued (as mlx-lm does).
  Its split mode compiles each decoder block in two parts around MLX's fused attention instead,
  which then reads exactly the written positions and needs no mask (MLX's CUDA attention kernel
  takes none: docs/decode.md).

The model code is mlx-lm's, unchanged: full-precision, MLX affine and vqpipe layers all trace
(vqpipe's qmv kernel is a custom-kernel primitive, which a compiled graph replays like any other).
Positions past ``capacity`` raise ValueError before anything is queued: the device-side index
would otherwise clamp silently.
"""

import time

import mlx.core as mx

from ..kernels import ext, small_arrays
from ..layers.qlinear import QuantizedLinear

POSITION_DTYPE = mx.int32


class StaticCache:
    """mlx-lm's KV-cache interface over buffers [B, kv_heads, capacity, head_dim]."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    @property
    def capacity(self):
        return self.keys.shape[2]

    def update_and_fetch(self, keys, values):
        if isinstance(self.offset, int):  # eager prefill: exactly KVCache's writes and slices
            end = self.offset + keys.shape[2]
            if end > self.capacity:
                raise ValueError(f"static KV cache full: {end} positions needed, capacity {self.capacity}")
            self.keys[..., self.offset:end, :] = keys
            self.values[..., self.offset:end, :] = values
            self.offset = end
            return self.keys[..., :end, :], self.values[..., :end, :]
        self.keys = write_kv(self.keys, keys, self.offset)
        self.values = write_kv(self.values, values, self.offset)
        return self.keys, self.values

    def make_mask(self, n, return_array=False, window_size=None):
        if window_size is not None:
            raise ValueError("static KV cache: sliding-window attention is not supported")
        if isinstance(self.offset, int):
            from mlx_lm.models.cache import create_attention_mask

            return create_attention_mask(n, self.offset, return_array, None)
        if n != 1:
            raise ValueError(f"static KV cache: the compiled step takes one token, got {n}")
        # Attend to positions 0..offset (this token's own entry included); the rest is unwritten.
        return (mx.arange(self.capacity, dtype=POSITION_DTYPE) <= self.offset).reshape(1, 1, 1, -1)


def check_model(model):
    """Raise ValueError unless every layer of ``model`` uses mlx-lm's plain full-attention KVCache."""
    why = model_problem(model)
    if why:
        raise ValueError(why)


def model_problem(model, mode="whole"):
    """Why ``model`` cannot take the compiled step in ``mode`` (a sentence), or None.

    Every mode needs mlx-lm's plain full-attention ``KVCache`` in every layer (a sliding-window
    layer's ``RotatingKVCache``, Gemma 3's, has no static form here). ``split`` also needs every
    decoder block to be one of :data:`SPLIT_MODULES`' (the block :func:`_block_parts` recomputes):
    mlx-lm's llama (Llama, Mistral), qwen2 and qwen3 blocks."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds != {KVCache.__name__}:
        return f"compiled decode supports full-attention KVCache layers only; this model uses {sorted(kinds)}"
    if mode == "split":
        other = sorted({type(b).__module__ for b in model.layers} - set(SPLIT_MODULES))
        if other:
            return (f"split compiled decode recomputes the decoder blocks of {', '.join(SPLIT_MODULES)}; "
                    f"this model's blocks are {', '.join(other)} (use mode whole, or the eager loop)")
    return None


class _Probe:
    """Records the (shape, dtype) of the keys and values a layer writes; computes nothing."""

    offset = 0

    def update_and_fetch(self, keys, values):
        self.shapes = (keys.shape, keys.dtype, values.shape, values.dtype)
        return keys, values

    def make_mask(self, n, return_array=False, window_size=None):
        return None


class _Paced:
    """Stands in for a decoder block during prefill: runs it and, where ``mark``, queues its output
    (``mx.async_eval``) and waits for the one queued before (the last group's). The host builds and
    queues a prefill's blocks much faster than the device runs them, and each dense weight a block
    decodes stays allocated until the device has run it: unpaced, the weights of nearly every layer were
    alive at once (qwen2.5-0.5b, 129-1025 tokens on an H100: 0.8-2.0 GB for a model of 0.25 GB).
    Paced, those of about two groups. Each wait costs ~0.1 ms of the device's time there, hence
    groups of blocks rather than every block. Attributes are the block's (the model may read them)."""

    def __init__(self, block, queue, mark):
        self.block, self.queue, self.mark = block, queue, mark

    def __getattr__(self, name):
        return getattr(self.block, name)

    def __call__(self, x, *args, **kwargs):
        y = self.block(x, *args, **kwargs)
        if self.mark:
            mx.async_eval(y)
            self.queue.append(y)
            if len(self.queue) > 1:
                mx.eval(self.queue.pop(0))  # queued already: waits for it
        return y


# Decoded weight bytes (16-bit) a GPU prefill queues between two waits (Decoder.prefill), for vqpipe
# models whose prompt chunk runs the dense path (more rows than ext.GPU_MAX_M). qwen2.5-0.5b's blocks
# decode 29.8 MB each: a wait every 4 blocks, the pace measured on an H100 (2.4-2.5x less peak for
# ~12 % more prefill time at 129-257 tokens, none at 1025: docs/results/2026-12-07-h100-prefill-pace/);
# a block of more than this (an 8B model's: 436 MB) waits after each. Not on the CPU: its backend
# frees each decoded weight as it goes (SmolLM2, 257 tokens: 29 MB peak either way) and pacing cost
# 2-5 % there (experiments/prefill_pace.py).
PACE_BYTES = 96 << 20
MODES = ("whole", "split", "eager")
# The mlx-lm modules whose decoder block _block_parts recomputes (model types llama, mistral, qwen2, qwen3)
SPLIT_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def write_kv(buf, new, pos):
    """``buf`` [B, heads, capacity, D] with ``new`` [B, heads, 1, D] written at position ``pos`` (a 0-d
    device array) by ``mx.put_along_axis``: a ScatterAxis over the one token's elements. Not
    ``mx.slice_update`` at an array start, which on MLX 0.32.4's CUDA backend launches an offset
    kernel and a copy kernel over the whole buffer, a cost that grows with the capacity
    (experiments/kv_write.py); end to end at 8B the two measured alike (docs/tried.md)."""
    return mx.put_along_axis(buf, mx.broadcast_to(pos.reshape(1, 1, 1, 1), new.shape), new, axis=2)


def _scalar(pos):
    """The position as a 0-d array: entry 0 of the padded position vector (a view), or itself."""
    return pos[0] if pos.ndim else pos


def to_kv_caches(kv, n):
    """mlx-lm ``KVCache`` per layer holding copies of the first ``n`` positions of ``kv`` (a
    Decoder's buffers, [(keys, values)]): what a prompt cache keeps after a compiled generation (the
    static buffers are reused by the next one)."""
    from mlx_lm.models.cache import KVCache

    caches = []
    for k, v in kv:
        c = KVCache()
        c.keys, c.values, c.offset = mx.contiguous(k[..., :n, :]), mx.contiguous(v[..., :n, :]), n
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def capacity_for(positions):
    """A static cache's capacity for ``positions``: the next power of two, at least 1024 (few
    distinct shapes, so few traces, for a Decoder kept between generations)."""
    return max(1024, 1 << (positions - 1).bit_length())


def default_mode(device=None):
    """The compiled step's mode that generate and serve take by default for greedy decoding with the
    full-precision cache: split on the CPU (1.30x mlx-lm's eager loop, SmolLM2 4-bit with the
    extension: docs/results/2026-12-07-cpu-serve/) and on CUDA (an H100, 0.5B shape: 261-266 against
    162-172 tok/s, docs/decode.md); None (mlx-lm's loop) on Metal, not measured."""
    device = device or mx.default_device()
    return "split" if device == mx.cpu or mx.cuda.is_available() else None


def _logprobs(logits):
    """mlx-lm's log-probabilities of one step's logits [1, vocab] -> [vocab]."""
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]


def _greedy(logits, like):
    return mx.argmax(logits, axis=-1).astype(like.dtype).reshape(1, 1)


class Decoder:
    """Greedy decode of ``model`` with a compiled step (see the module docstring).

    ``capacity``: the KV positions each generation may use (at least prompt + new tokens); the trace
    is reused for every generation with this capacity. ``mode``:

    - ``"whole"``: the whole step is one compiled function. Attention then runs over the whole
      buffer under an array mask, which MLX's CUDA SDPA does not take (0.32.4: its vector kernel
      has no array-mask path), so attention falls back to 5 primitives per layer over ``capacity``
      keys (measured: docs/decode.md).
    - ``"split"``: per decoder block two compiled functions, before attention (norm, projections,
      rope, cache write) and after it (output projection, MLP, residuals), with MLX's fused SDPA
      called between them, eagerly, on the buffers sliced to the valid length (a host int): no mask,
      the fast kernel, and nothing else left to Python. mlx-lm's llama/qwen2/qwen3 blocks only
      (:data:`SPLIT_MODULES`).
    - ``"eager"``: the whole step uncompiled (tests; what the static cache alone costs).
    """

    def __init__(self, model, capacity, mode="whole"):
        if mode not in MODES:
            raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
        why = model_problem(model, mode)
        if why:
            raise ValueError(why)
        if capacity < 2:
            raise ValueError(f"static KV cache capacity must be >= 2, got {capacity}")
        self.model, self.capacity, self.mode = model, int(capacity), mode
        self._layout = None
        self._block_bytes = None  # per block, the bytes its vqpipe layers decode in a prefill: :meth:`waits`
        self.traces = 0  # Python runs of the step (whole) or of the blocks' first parts (split): traces when compiled
        if mode == "split":
            self._parts = [_block_parts(layer, self._traced) for layer in model.layers]
            self._embed = mx.compile(model.model.embed_tokens)
            self._head = mx.compile(self._logits)
            self._run = self._split_step
        else:
            self._run = mx.compile(self._step) if mode == "whole" else self._step
        self.position = None  # host copy of the position the next step writes (split mode slices by it)
        self.kv = None  # the buffers of :meth:`tokens`' last step

    def step(self, token, pos, state):
        """One token: (next token, pos + 1, buffers, logits); :meth:`start` gives the first arguments."""
        if self.position is None:
            raise ValueError("compiled decode: call start() before step()")
        if self.position >= self.capacity:
            raise ValueError(f"static KV cache full: position {self.position}, capacity {self.capacity}")
        out = self._run(token, pos, state)
        self.position += 1
        return out

    def _traced(self):
        self.traces += 1

    def _logits(self, h):
        h = self.model.model.norm(h)
        head = self.model.model.embed_tokens.as_linear if self.model.args.tie_word_embeddings else self.model.lm_head
        return head(h)[:, -1, :]

    def _step(self, token, pos, state):
        self.traces += 1
        caches = [StaticCache(k, v, _scalar(pos)) for k, v in state]
        logits = self.model(token, cache=caches)[:, -1, :]
        return _greedy(logits, token), pos + 1, [(c.keys, c.values) for c in caches], logits

    def _split_step(self, token, pos, state):
        n = self.position + 1  # valid positions once this token is written
        h = self._embed(token)
        p = _scalar(pos)
        new = []
        for (pre, post, scale), (kb, vb) in zip(self._parts, state):
            q, kb, vb = pre(h, p, kb, vb)
            o = mx.fast.scaled_dot_product_attention(q, kb[..., :n, :], vb[..., :n, :], scale=scale)
            h = post(h, o)
            new.append((kb, vb))
        logits = self._head(h)
        return _greedy(logits, token), pos + 1, new, logits

    def layout(self):
        """Per layer (key shape, key dtype, value shape, value dtype) of one token, found once by
        building (never evaluating) a one-token graph."""
        if self._layout is None:
            probes = [_Probe() for _ in self.model.layers]
            self.model(mx.zeros((1, 1), mx.int32), cache=probes)
            self._layout = [p.shapes for p in probes]
        return self._layout

    def new_cache(self):
        out = []
        for ks, kd, vs, vd in self.layout():
            k = mx.zeros((ks[0], ks[1], self.capacity, ks[3]), kd)
            v = mx.zeros((vs[0], vs[1], self.capacity, vs[3]), vd)
            out.append(StaticCache(k, v, 0))
        return out

    def prefill(self, prompt, caches, prefill_step=2048, pace=None):
        """Every prompt token but the last through the eager model, in chunks, as mlx-lm does, its
        blocks paced (:class:`_Paced`): ``pace`` an int waits every ``pace`` blocks (0 never: the
        whole chunk queued at once, as mlx-lm does); None, on a GPU for a vqpipe model's chunks of
        more than ext.GPU_MAX_M rows, each time :data:`PACE_BYTES` of decoded weights have been
        queued since the last wait, else never. The same values either way."""
        n = int(prompt.size)
        if n < 1:
            raise ValueError("compiled decode: empty prompt")
        if pace is not None and (isinstance(pace, bool) or not isinstance(pace, int) or pace < 0):
            raise ValueError(f"prefill pace must be a whole number of blocks >= 0, got {pace!r}")
        inner = self.model.model
        blocks = inner.layers
        done = 0
        try:
            while n - done > 1:
                k = min(prefill_step, n - done - 1)
                marks = self.waits(k) if pace is None else [pace > 0 and (i + 1) % pace == 0
                                                            for i in range(len(blocks))]
                queue = []
                inner.layers = [_Paced(b, queue, m) for b, m in zip(blocks, marks)] if any(marks) else blocks
                self.model(prompt[done:done + k][None], cache=caches)
                mx.eval([(c.keys, c.values) for c in caches])
                done += k
        finally:
            inner.layers = blocks
        return prompt[done:][None].astype(POSITION_DTYPE), done

    def waits(self, rows, device=None):
        """Per block, whether a prefill chunk of ``rows`` rows waits after it by default
        (:meth:`prefill`): on a GPU (``device``, default MLX's), above ext.GPU_MAX_M rows, each time
        the blocks since the last wait decode :data:`PACE_BYTES` of weights (2 bytes a weight of
        their vqpipe layers); never on the CPU, at or below the mat-vec's rows, or without vqpipe layers."""
        blocks = self.model.model.layers
        if (device or mx.default_device()) != mx.gpu or rows <= ext.GPU_MAX_M:
            return [False] * len(blocks)
        if self._block_bytes is None:
            self._block_bytes = [sum(2 * m.in_features * m.out_features for _, m in b.named_modules()
                                     if isinstance(m, QuantizedLinear)) for b in blocks]
        marks, queued = [], 0
        for size in self._block_bytes:
            queued += size
            marks.append(size > 0 and queued >= PACE_BYTES)
            if marks[-1]:
                queued = 0
        return marks

    def start(self, prompt, prefill_step=2048, prefix=None):
        """Fresh buffers, the prompt but its last token prefilled: (last token, position, buffers),
        the arguments of the first :meth:`step`. ``prefix``: per layer the keys and values
        [B, heads, n, D] of n positions before ``prompt`` (a prompt cache's), written first."""
        caches = self.new_cache()
        n0 = 0
        for c, (k, v) in zip(caches, prefix or ()):
            n0 = k.shape[2]
            c.keys[..., :n0, :] = k
            c.values[..., :n0, :] = v
            c.offset = n0
        token, done = self.prefill(prompt, caches, prefill_step)
        self.position = n0 + done
        # padded, the position's buffer is not in MLX's small pool (small_arrays.py); the step reads entry 0
        pos = small_arrays.array([n0 + done], POSITION_DTYPE)
        return token, pos, [(c.keys, c.values) for c in caches]

    def tokens(self, prompt, max_tokens, prefill_step=2048, logprobs=False, prefix=None):
        """Greedy ids one by one (for streaming), step i + 1 queued before token i is read. With
        ``logprobs``: (id, log-probabilities [vocab]) pairs, as mlx-lm's generate_step gives them;
        ``prefix``: as :meth:`start`. While it runs, ``self.kv`` holds the buffers of the last step
        queued, whose first ``self.position`` positions are written."""
        n0 = prefix[0][0].shape[2] if prefix else 0
        if n0 + int(prompt.size) + max_tokens > self.capacity:
            raise ValueError(f"compiled decode: a {n0 + prompt.size}-token prompt and {max_tokens} new tokens need "
                             f"{n0 + prompt.size + max_tokens} KV positions; the static cache holds {self.capacity}")
        token, pos, self.kv, logits = self.step(*self.start(prompt, prefill_step, prefix))
        lp = _logprobs(logits) if logprobs else None
        for i in range(max_tokens):
            current, current_lp = token, lp
            if i + 1 < max_tokens:
                token, pos, self.kv, logits = self.step(token, pos, self.kv)
                lp = _logprobs(logits) if logprobs else None
                mx.async_eval(token if lp is None else [token, lp])
            yield (int(current.item()), current_lp) if logprobs else int(current.item())

    def generate(self, prompt, max_tokens, prefill_step=2048):
        """Greedy ids of ``max_tokens`` new tokens, with the timings bench-decode records:
        ``{"prefill_s": call to first token evaluated, "decode_s": from there through
        ``max_tokens`` more steps (the last one's token is dropped, as mlx-lm drops it), "ids"}``."""
        n = int(prompt.size)
        if n + max_tokens > self.capacity:  # the last step's token is dropped: it writes no position
            raise ValueError(f"compiled decode: a {n}-token prompt and {max_tokens} new tokens need "
                             f"{n + max_tokens} KV positions; the static cache holds {self.capacity}")
        mx.synchronize()
        t0 = time.perf_counter()
        token, pos, state = self.start(prompt, prefill_step)
        token, pos, state, _ = self.step(token, pos, state)
        mx.eval(token)
        t1 = time.perf_counter()
        ids = []
        for _ in range(max_tokens):
            nxt, pos, state, _ = self.step(token, pos, state)  # queued before token is read
            mx.async_eval(nxt)
            ids.append(int(token.item()))
            token = nxt
        mx.synchronize()
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "ids": ids}


def _block_parts(layer, traced):
    """(before attention, after attention, scale) of one mlx-lm llama/qwen2/qwen3 decoder block for
    one token, the first two compiled; the same operations as the block's ``__call__`` (qwen3's
    per-head q/k norms over the last axis, as there)."""
    attn = layer.self_attn
    qk_norm = "q_norm" in attn

    def before(h, pos, kb, vb):
        traced()
        x = layer.input_layernorm(h)
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        # One token: [1, 1, heads·D] is already [1, heads, 1, D] in memory, so one reshape replaces
        # mlx-lm's reshape + transpose: fewer graph nodes, the same logits
        q = q.reshape(1, attn.n_heads, 1, -1)
        k = k.reshape(1, attn.n_kv_heads, 1, -1)
        v = v.reshape(1, attn.n_kv_heads, 1, -1)
        if qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rope(q, offset=pos), attn.rope(k, offset=pos)
        return q, write_kv(kb, k, pos), write_kv(vb, v, pos)

    def after(h, o):
        o = o.reshape(1, 1, -1)  # [1, heads, 1, D] -> [1, 1, heads·D]: the same memory for one token
        h = h + attn.o_proj(o)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    return mx.compile(before), mx.compile(after), attn.scale
