"""KIVICache: flush schedule, chunking invariance, trim, sizes, and mlx-lm generation (CPU)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load, stream_generate
from mlx_lm.models.cache import KVCache

from vqpipe.kivi import quantizer
from vqpipe.kivi.cache import KIVICache, cache_stats, make_kivi_cache

CORPUS = Path(__file__).parents[1] / "vqpipe" / "data" / "corpus.txt"


def _stream(n, b=1, h=2, d=16, seed=0, dtype=mx.float32):
    mx.random.seed(seed)
    k = (mx.random.normal((b, h, n, d)) * 2).astype(dtype)
    v = (mx.random.normal((b, h, n, d)) + 1).astype(dtype)
    mx.eval(k, v)
    return k, v


def _feed(cache, k, v, chunks):
    start = 0
    for n in chunks:
        ks, vs = cache.update_and_fetch(k[..., start : start + n, :], v[..., start : start + n, :])
        start += n
    mx.eval(ks, vs)
    return ks, vs


def _expected(k, v, nq, bits, g):
    """Tokens [0, nq) fake-quantized group by group, the rest untouched."""
    kq = quantizer.fake_quant_keys(k[..., :nq, :], bits, g)[0]
    vq = quantizer.fake_quant_values(v[..., :nq, :], bits, g)[0]
    return mx.concatenate([kq, k[..., nq:, :]], axis=2), mx.concatenate([vq, v[..., nq:, :]], axis=2)


def test_flush_schedule_one_token_at_a_time():
    r, g = 8, 4
    k, v = _stream(60)
    c = KIVICache(bits=4, group_size=g, residual_length=r)
    for t in range(1, 61):
        c.update_and_fetch(k[..., t - 1 : t, :], v[..., t - 1 : t, :])
        want = g * (max(0, t - r) // g)
        assert c.quantized == want, t
        assert c.flushes == want // g
        if t >= r:
            assert r <= c.offset - c.quantized < r + g


@pytest.mark.parametrize("chunks", [[1] * 97, [50, 47], [97], [3, 30, 1, 1, 40, 22], [9, 9, 9, 70]])
def test_contents_do_not_depend_on_chunking(chunks):
    bits, g, r = 2, 8, 16
    k, v = _stream(97, d=24)  # 24 channels with G=8: three groups per token
    ks, vs = _feed(KIVICache(bits, g, r), k, v, chunks)
    nq = g * ((97 - r) // g)
    ek, ev = _expected(k, v, nq, bits, g)
    assert np.array_equal(np.array(ks), np.array(ek))
    assert np.array_equal(np.array(vs), np.array(ev))


def test_ragged_value_groups_and_fp16():
    k, v = _stream(80, d=40, dtype=mx.float16)  # G=32 on 40 channels: a ragged value group
    c = KIVICache(4, 32, 16)
    ks, vs = _feed(c, k, v, [33, 1, 46])
    ek, ev = _expected(k, v, c.quantized, 4, 32)
    assert c.quantized == 64 and ks.dtype == mx.float16
    assert np.array_equal(np.array(ks), np.array(ek)) and np.array_equal(np.array(vs), np.array(ev))


def test_trim_keeps_quantized_prefix_and_resumes():
    g, r = 4, 8
    k, v = _stream(40)
    c = KIVICache(4, g, r)
    _feed(c, k, v, [30])
    assert (c.offset, c.quantized) == (30, 20)
    assert c.is_trimmable() and c.trim(5) == 5
    assert (c.offset, c.quantized) == (25, 20)
    assert c.trim(7) == 7  # into the quantized region
    assert (c.offset, c.quantized) == (18, 18)
    ks, _ = c.update_and_fetch(k[..., 18:31, :], v[..., 18:31, :])  # residual 13 >= r + g: flush 4
    assert (c.offset, c.quantized) == (31, 22)
    want = mx.concatenate(
        [
            quantizer.fake_quant_keys(k[..., :20, :], 4, g)[0][..., :18, :],
            quantizer.fake_quant_keys(k[..., 18:22, :], 4, g)[0],
            k[..., 22:31, :],
        ],
        axis=2,
    )
    assert np.array_equal(np.array(ks), np.array(want))
    assert c.trim(100) == 31 and c.offset == 0 and c.quantized == 0


def test_sizes_are_labelled_and_separate():
    b, h, d = 2, 3, 64
    k, v = _stream(300, b=b, h=h, d=d, dtype=mx.float16)
    c = KIVICache(bits=4, group_size=32, residual_length=128)
    assert c.nbytes == 0 and c.compressed_nbytes == 0 and c.empty()
    _feed(c, k, v, [300])
    assert c.quantized == 160
    residual = 2 * b * h * 140 * d * 2
    # two 256-token buffer steps, plus the copy of the 140 residual tokens the flushes read from
    assert c.nbytes == c.keys.nbytes + c.values.nbytes + residual == 2 * b * h * 512 * d * 2 + residual
    packed_keys = b * h * 160 * d * 4 // 8 + 4 * (b * h * (160 // 32) * d)
    packed_values = b * h * 160 * d * 4 // 8 + 4 * (b * h * 160 * (d // 32))
    assert c.compressed_nbytes == packed_keys + packed_values + residual
    s = c.stats()
    assert s["resident_nbytes"] == c.nbytes and s["compressed_nbytes"] == c.compressed_nbytes
    assert s["uncompressed_nbytes"] == 2 * b * h * 300 * d * 2
    assert s["compressed_nbytes"] < s["uncompressed_nbytes"] < s["resident_nbytes"]


def test_state_round_trip():
    k, v = _stream(50)
    c = KIVICache(4, 8, 16)
    _feed(c, k, v, [50])
    d = KIVICache(4, 8, 16)
    d.state, d.meta_state = c.state, c.meta_state
    assert (d.offset, d.quantized, d.flushes) == (c.offset, c.quantized, c.flushes)
    k2, v2 = _stream(10, seed=1)
    a = c.update_and_fetch(k2, v2)
    b = d.update_and_fetch(k2, v2)
    assert np.array_equal(np.array(a[0]), np.array(b[0])) and np.array_equal(np.array(a[1]), np.array(b[1]))


@pytest.fixture(scope="module")
def tiny(tiny_source):
    return load(str(tiny_source))


def _prompt(tokenizer, n):
    ids = tokenizer.encode(CORPUS.read_text(encoding="utf-8")[: 8 * n])
    assert len(ids) >= n
    return ids[:n]


def test_make_kivi_cache_layers(tiny):
    model, _ = tiny
    caches = make_kivi_cache(model, bits=2, group_size=16, residual_length=32, packed=False)
    assert len(caches) == len(model.layers)
    assert all(isinstance(c, KIVICache) for c in caches)
    # mlx-lm sends any cache with a `bits` attribute to its quantized attention path.
    assert not any(hasattr(c, "bits") for c in caches)
    assert caches[0].kv_bits == 2 and caches[0].group_size == 16 and caches[0].residual_length == 32


def test_generate_without_flush_equals_plain_cache(tiny):
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 60)
    plain = generate(model, tokenizer, prompt, max_tokens=20)
    c = make_kivi_cache(model, residual_length=10**6, packed=False)
    assert generate(model, tokenizer, prompt, max_tokens=20, prompt_cache=c) == plain
    assert cache_stats(c)["quantized_tokens"] == 0


def test_generate_with_flushes_and_chunked_prefill(tiny):
    # GQA (4 query heads, 2 KV heads), prefill in 16-token chunks, flushes during prefill and decode.
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 100)
    bits, g, r = 4, 16, 32
    runs = {}
    for step in (16, 2048):
        c = make_kivi_cache(model, bits, g, r, packed=False)
        out = list(stream_generate(model, tokenizer, prompt, max_tokens=40, prompt_cache=c, prefill_step_size=step))
        runs[step] = (out, c)
        s = cache_stats(c)
        total = s["offset"]  # generate_step may already have fed the token after the last one yielded
        assert len(prompt) + 39 <= total <= len(prompt) + 40
        assert s["quantized_tokens"] == g * ((total - r) // g)
        assert s["flushes"] == len(model.layers) * ((total - r) // g)
        assert out[-1].generation_tokens == 40
    # Same flush groups whatever the chunking, so the same tokens are quantized in every layer;
    # attention over chunks differs only in float rounding.
    a, b = (runs[s][1][0] for s in (16, 2048))
    assert a.quantized == b.quantized and a.flushes == b.flushes


def test_prefill_across_2048_token_chunks(tiny):
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 2100)
    c = make_kivi_cache(model, bits=4, group_size=32, residual_length=128, packed=False)
    text = generate(model, tokenizer, prompt, max_tokens=3, prompt_cache=c)
    assert isinstance(text, str)
    s = cache_stats(c)
    assert 2102 <= s["offset"] <= 2103 and s["quantized_tokens"] == 32 * ((s["offset"] - 128) // 32)


def test_other_cache_kinds_are_kept():
    class Fake:
        layers = [0, 1]

        def make_cache(self):
            return [KVCache(), "rotating"]

    caches = make_kivi_cache(Fake(), packed=False)
    assert isinstance(caches[0], KIVICache) and caches[1] == "rotating"
