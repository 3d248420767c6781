"""Packed KIVI cache and the attention that reads its codes.

CPU: packing, the store against the reference cache (schedule, codes, parameters), the tile path
against a float64 evaluation over the dequantized cache, masks, state through mlx-lm's prompt-cache
files, trim, sizes, generation (same tokens as the reference cache), and the CUDA rendering of the
decode kernel run on the host (tests/kivi_host.py). GPU (``gpu`` marker): the kernel itself.
"""

import argparse
import itertools
import re
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

import kivi_host
import kivi_v4_model
from vqpipe.kivi import attention, decode_kernel, kernels, bitpack, quantizer
from vqpipe.kivi.cache import KIVICache, make_kivi_cache
from vqpipe.kivi.store import PackedKIVICache

CORPUS = Path(__file__).parents[1] / "vqpipe" / "data" / "corpus.txt"
U = 2.0**-24  # float32 unit roundoff
needs_gpu = pytest.mark.skipif(kernels.backend() is None, reason="needs MLX's Metal or CUDA backend")


def _kv(b, h, s, d, dtype="float32", seed=0):
    key = mx.random.split(mx.random.key(seed))
    k = mx.random.normal((b, h, s, d), key=key[0]) * 2 + 0.5
    v = mx.random.normal((b, h, s, d), key=key[1])
    return k.astype(getattr(mx, dtype)), v.astype(getattr(mx, dtype))


def _filled(bits, g, r, k, v, chunks):
    c = PackedKIVICache(bits, g, r)
    a = 0
    for n in chunks:
        c.update_and_fetch(k[..., a : a + n, :], v[..., a : a + n, :])
        a += n
    mx.eval(c.state[:6])
    return c


# --- float64 evaluation over the dequantized cache and its float32 bound -------------------------


def _dequantized64(cache):
    """(K̂, V̂, key terms, value terms) in float64: the codes times the stored float16 scale plus
    zero, then the residual; the terms are |scale·code| + |zero| per element (|x| for the residual),
    the magnitudes a float32 evaluation rounds."""
    g, bits, nq = cache.group_size, cache.kv_bits, cache.quantized
    rk, rv = (np.array(a.astype(mx.float32)).astype(np.float64) for a in cache.residual())
    if nq == 0:
        return rk, rv, np.abs(rk), np.abs(rv)
    kc = np.array(bitpack.unpack_keys(cache.kc, bits)).astype(np.float64)[:, :, :nq]
    kp = np.repeat(np.array(cache.kp.astype(mx.float32)).astype(np.float64)[:, :, : nq // g], g, axis=2)
    vc = np.array(bitpack.unpack_words(cache.vc, bits)).astype(np.float64)[:, :, :nq]
    vp = np.array(cache.vp.astype(mx.float32)).astype(np.float64)[:, :, :nq]
    vp = np.repeat(vp, g, axis=-2)[..., : vc.shape[-1], :]
    k, v = kc * kp[..., 0] + kp[..., 1], vc * vp[..., 0] + vp[..., 1]
    kt, vt = np.abs(kc * kp[..., 0]) + np.abs(kp[..., 1]), np.abs(vc * vp[..., 0]) + np.abs(vp[..., 1])
    cat = lambda a, b: np.concatenate([a, b], axis=2)  # noqa: E731
    return cat(k, rk), cat(v, rv), cat(kt, np.abs(rk)), cat(vt, np.abs(rv))


def _mask64(mask, lq, s):
    if mask is None or (isinstance(mask, str) and lq == 1):
        return None
    if isinstance(mask, str):
        return np.arange(s - lq, s)[:, None] >= np.arange(s)[None]
    return np.array(mask)


def reference(queries, cache, scale, mask=None, split=0.0, tokens=None):
    """(softmax(q·K̂ᵀ·scale + mask)·V̂ in float64 [B, Hq, L, D], its float32 accumulation bound per
    element). The bound: scores off by at most δ = (D + 8)·u·Σ_d |q_d|·scale·(key terms), which
    moves the softmax weights by a factor within exp(±2δ); the exponentials' own error (8u); and the
    sums over tokens and channels, (S + D + 64)·u times the weighted value terms. ``split``: kernel
    v4's hi + lo operands (2^-16 relative each) add split·Σ_d |q_d|·scale·(key terms) to δ and
    split times the weighted value terms. ``tokens``: only the first that many (the quantized part)."""
    k, v, kt, vt = _dequantized64(cache)
    if tokens is not None:
        k, v, kt, vt = (a[:, :, :tokens] for a in (k, v, kt, vt))
    b, hq, lq, d = queries.shape
    h, s = k.shape[1], k.shape[2]
    r = hq // h
    q = np.array(queries.astype(mx.float32)).astype(np.float64).reshape(b, h, r * lq, d)
    sc = np.einsum("bhid,bhtd->bhit", q, k) * scale
    mag = np.einsum("bhid,bhtd->bhit", np.abs(q), kt) * scale
    m = _mask64(mask, lq, s)
    if m is not None:
        sc = sc.reshape(b, hq, lq, s)
        sc = np.where(m, sc, -np.inf) if m.dtype == bool else sc + m
        sc = sc.reshape(b, h, r * lq, s)
    w = np.exp(sc - sc.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("bhit,bhtd->bhid", w, v)
    delta = ((d + 8) * U + split) * np.max(np.where(w > 0, mag, 0), axis=-1, keepdims=True) * 1.1
    vmax = np.einsum("bhit,bhtd->bhid", w, np.abs(v))
    tol = (2.01 * delta + 8 * U) * np.max(np.abs(v), axis=2, keepdims=True) + ((s + d + 64) * U + split) * (
        np.einsum("bhit,bhtd->bhid", w, vt) + vmax
    )
    return out.reshape(b, hq, lq, d), tol.reshape(b, hq, lq, d)


def _ulp(x, dtype):
    """Half an ulp of x in the output dtype (the final rounding)."""
    bits = {"float32": 24, "float16": 11, "bfloat16": 8}[dtype]
    return np.abs(x) * 2.0**-bits + (2.0**-24 if dtype == "float16" else 0)


def assert_within(got, queries, cache, scale, mask=None, what="", split=0.0):
    want, tol = reference(queries, cache, scale, mask, split)
    dt = str(got.dtype).split(".")[-1]
    err = np.abs(np.array(got.astype(mx.float32)).astype(np.float64) - want)
    limit = tol + _ulp(want, dt)
    assert np.all(err <= limit), f"{what}: worst error {err.max():.3g}, at {np.unravel_index(np.argmax(err / limit), err.shape)}, ratio {np.max(err / limit):.3g}"
    return err, tol


# --- packing and the store ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_round_trip(bits):
    mx.random.seed(bits)
    codes = mx.random.randint(0, 2**bits, (2, 3, 64, 48)).astype(mx.uint8)
    w = bitpack.pack_keys(codes, bits, 32)
    assert w.shape == (2, 3, 2, 48 * bits // 32, 32) and w.dtype == mx.uint32
    assert mx.array_equal(bitpack.unpack_keys(w, bits), codes.astype(mx.uint32))
    wv = bitpack.pack_words(codes, bits)
    assert mx.array_equal(bitpack.unpack_words(wv, bits), codes.astype(mx.uint32))
    # lowest bits first: channel 1 of word 0 sits at bit `bits`
    one = mx.zeros((1, 48), mx.uint8)
    one[0, 1] = 1
    assert bitpack.pack_words(one, bits)[0, 0].item() == 1 << bits


def test_geometry_errors_name_the_problem():
    with pytest.raises(ValueError, match="2, 4 or 8"):
        PackedKIVICache(bits=3)
    c = PackedKIVICache(bits=4, group_size=32)
    k = mx.zeros((1, 1, 4, 20))
    with pytest.raises(ValueError, match="head dim 20"):
        c.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="group_size 12"):
        PackedKIVICache(bits=2, group_size=12).update_and_fetch(mx.zeros((1, 1, 4, 32)), mx.zeros((1, 1, 4, 32)))


@pytest.mark.parametrize("bits,g,d", [(4, 32, 64), (4, 32, 40), (8, 64, 128), (2, 16, 48)])
def test_store_is_the_reference_quantizer_in_packed_form(bits, g, d):
    """Schedule, codes and residual as the reference cache; scale and zero are the reference's
    float32 values rounded to float16."""
    k, v = _kv(2, 3, 333, d, "bfloat16", seed=bits)
    chunks = [100, 1, 1, 150, 17, 64]
    p = _filled(bits, g, 48, k, v, chunks)
    ref = KIVICache(bits, g, 48)
    a = 0
    for n in chunks:
        ref.update_and_fetch(k[..., a : a + n, :], v[..., a : a + n, :])
        a += n
    nq = g * ((333 - 48) // g)
    assert (p.offset, p.quantized, p.flushes) == (ref.offset, ref.quantized, ref.flushes) == (333, nq, nq // g)
    qk, ks, kz = quantizer.quantize_keys(k[..., :nq, :], bits, g)
    qv, vs, vz = quantizer.quantize_values(v[..., :nq, :], bits, g)
    assert mx.array_equal(bitpack.unpack_keys(p.kc[:, :, : nq // g], bits), qk.astype(mx.uint32))
    assert mx.array_equal(bitpack.unpack_words(p.vc[:, :, :nq], bits), qv.astype(mx.uint32))
    assert mx.array_equal(p.kp[:, :, : nq // g], bitpack.params(ks, kz))
    assert mx.array_equal(p.vp[:, :, :nq], bitpack.params(vs, vz))
    rk, rv = p.residual()
    assert mx.array_equal(rk, k[..., nq:, :]) and mx.array_equal(rv, v[..., nq:, :])
    # dequantized: the reference's x_hat up to the float16 rounding of scale and zero
    kh, vh = p.dequantized(0, nq)
    bound = lambda s, z, c: np.abs(np.array(c)) * np.array(s) * 2**-11 + np.abs(np.array(z)) * 2**-11  # noqa: E731
    assert np.all(np.abs(np.array(kh) - np.array(quantizer.dequantize_keys(qk, ks, kz, g))) <= bound(mx.repeat(ks, g, 2), mx.repeat(kz, g, 2), qk) + 1e-6)


def test_nbytes_is_resident_and_near_the_packed_size():
    """At 32k tokens (the memory goal's context): resident bytes within 5 % of the packed size, and
    under 0.35x (KIVI-4) and 0.22x (KIVI-2) of the fp16 cache's."""
    b, h, d, n = 1, 2, 128, 32768
    k, v = _kv(b, h, n, d, "float16")
    for bits in (2, 4):
        c = _filled(bits, 32, 128, k, v, [8192] * 4)
        theory = c.packed_nbytes()
        assert theory == (2 * b * h * c.quantized * d * bits // 8 + 4 * b * h * (c.quantized // 32) * d * 2
                          + 2 * b * h * c.nres * d * 2)
        assert c.nbytes == sum(a.nbytes for a in (c.kc, c.kp, c.vc, c.vp, *c.residual_buffers()[:2]))
        assert theory <= c.nbytes <= 1.05 * theory
        fp16 = KVCache()
        fp16.update_and_fetch(k, v)
        ratio = c.nbytes / fp16.nbytes
        assert ratio < {2: 0.22, 4: 0.35}[bits], ratio


def test_state_round_trips_through_prompt_cache_files(tmp_path):
    k, v = _kv(1, 2, 300, 64, "float16")
    caches = [_filled(4, 32, 64, k, v, [250]), _filled(2, 32, 0, k, v, [95, 1]), _filled(8, 64, 256, k, v, [250])]
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [PackedKIVICache] * 3
    assert loaded[2].quantized == 0 and loaded[1].nres == 0
    for a, b in zip(caches, loaded):
        assert (a.kv_bits, a.group_size, a.residual_length, a.offset, a.quantized, a.flushes, a.nres) == (
            b.kv_bits, b.group_size, b.residual_length, b.offset, b.quantized, b.flushes, b.nres)
        for x, y in zip(a.state[:6], b.state[:6]):
            assert mx.array_equal(x, y)
        # both continue the same way
        a.update_and_fetch(k[..., 250:300, :], v[..., 250:300, :])
        b.update_and_fetch(k[..., 250:300, :], v[..., 250:300, :])
        for x, y in zip(a.state[:6], b.state[:6]):
            assert mx.array_equal(x, y)


def test_trim():
    k, v = _kv(1, 2, 200, 32, "float32")
    c = _filled(4, 16, 32, k, v, [150])
    assert (c.offset, c.quantized, c.nres) == (150, 112, 38)
    assert c.trim(10) == 10 and (c.offset, c.quantized, c.nres) == (140, 112, 28)
    assert mx.array_equal(c.residual()[0], k[..., 112:140, :])  # within the residual: exact
    kh, _ = c.dequantized(96, 112)
    assert c.trim(35) == 35 and (c.offset, c.quantized, c.nres) == (105, 96, 9)
    # into a group: its kept tokens return to the residual as their dequantized values
    assert mx.array_equal(c.residual()[0], kh[..., :9, :])
    c.update_and_fetch(k[..., 105:200, :], v[..., 105:200, :])
    assert c.offset == 200 and c.quantized == 96 + 16 * ((200 - 96 - 32) // 16)
    assert c.trim(500) == 200 and c.offset == 0 and c.quantized == 0


# --- the tile path ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hk,ratio,d,bits,g,lq,mask",
    [
        (1, 1, 64, 4, 32, 1, None),
        (2, 4, 128, 2, 32, 1, "causal"),
        (4, 2, 64, 8, 64, 7, "causal"),
        (8, 8, 64, 4, 32, 3, "causal"),
        (2, 3, 128, 4, 32, 5, "bool"),
        (1, 5, 64, 2, 16, 4, "additive"),
    ],
)
def test_tiles_within_float32_bound_for_every_tile_size(hk, ratio, d, bits, g, lq, mask):
    k, v = _kv(1, hk, 419, d, "float32", seed=hk * ratio)
    c = _filled(bits, g, 40, k, v, [300, 119])
    q = mx.random.normal((1, hk * ratio, lq, d), key=mx.random.key(7)) * 1.5
    m = mask
    if mask == "bool":
        m = mx.random.uniform(shape=(lq, 419), key=mx.random.key(3)) > 0.3
        m[:, 0] = True
    elif mask == "additive":
        m = mx.random.normal((1, hk * ratio, lq, 419), key=mx.random.key(4))
    outs = []
    for tile in (g, 64, 160, 4096):
        out = attention.attend_tiles(q, c, d**-0.5, m, tile=tile)
        assert_within(out, q, c, d**-0.5, m, f"tile {tile}")
        outs.append(np.array(out))
    # tile sizes change only the order of float32 sums
    _, tol = reference(q, c, d**-0.5, m)
    assert all(np.all(np.abs(o - outs[0]) <= 2 * tol) for o in outs)


def test_tiles_evaluated_as_they_go_bound_the_transient(monkeypatch):
    """The tile path evaluates its running state every EVAL_SCORES scores: the same bytes, and the
    tiles' transients do not pile up (on MLX's CUDA backend they otherwise live until the GPU ran
    every queued tile)."""
    k, v = _kv(1, 2, 4096, 64, "float16", seed=5)
    c = _filled(4, 32, 128, k, v, [4096])
    q = mx.random.normal((1, 14, 256, 64), key=mx.random.key(5)).astype(mx.float16)
    monkeypatch.setattr(attention, "SCORES", 1 << 17)
    outs, peaks = [], []
    for every in (1 << 40, 1 << 17):
        monkeypatch.setattr(attention, "EVAL_SCORES", every)
        mx.eval(attention.attend_tiles(q, c, 0.125, "causal"))  # warm
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        outs.append(attention.attend_tiles(q, c, 0.125, "causal"))
        mx.eval(outs[-1])
        peaks.append(mx.get_peak_memory() - base)
    assert mx.array_equal(outs[0], outs[1])
    assert peaks[1] * 2 < peaks[0], peaks


def test_tiles_equal_sdpa_over_the_dequantized_cache():
    k, v = _kv(1, 2, 300, 64, "float32")
    c = _filled(4, 32, 64, k, v, [300])
    kh, vh = c.dequantized(0, c.quantized)
    rk, rv = c.residual()
    q = mx.random.normal((1, 4, 6, 64))
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([kh, rk], 2), mx.concatenate([vh, rv], 2), scale=0.125, mask="causal")
    got = attention.attend(q, c, 0.125, "causal", use_kernels=False)
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4)


# --- mlx-lm integration --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_source):
    return load(str(tiny_source))


def _prompt(tokenizer, n):
    return tokenizer.encode(CORPUS.read_text(encoding="utf-8")[: 8 * n])[:n]


def test_install_routes_only_packed_caches(tiny):
    model, _ = tiny
    import mlx_lm.models.qwen2 as qwen2

    attention.install(model)
    assert attention.install(model) == []  # idempotent
    fn = qwen2.scaled_dot_product_attention
    assert hasattr(fn, "vqpipe_kivi_original")
    q, k = mx.random.normal((1, 4, 3, 64)), mx.random.normal((1, 2, 3, 64))
    plain = fn(q, k, k, cache=KVCache(), scale=0.1, mask="causal")
    assert mx.allclose(plain, mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1, mask="causal"))


def _tokens(model, tokenizer, prompt, cache, n=24, **kw):
    return [o.token for o in stream_generate(model, tokenizer, prompt, max_tokens=n, prompt_cache=cache, **kw)]


@pytest.mark.parametrize("bits", [4, 2])
def test_generation_same_tokens_as_reference_cache(tiny, bits):
    """Prefill in 64-token chunks (flushes in prefill and decode), GQA: the packed cache's tokens
    equal the reference cache's."""
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 300)
    ref = _tokens(model, tokenizer, prompt, make_kivi_cache(model, bits, 32, 64, packed=False), prefill_step_size=64)
    c = make_kivi_cache(model, bits, 32, 64, packed=True)
    assert all(isinstance(x, PackedKIVICache) for x in c)
    assert _tokens(model, tokenizer, prompt, c, prefill_step_size=64) == ref
    assert c[0].quantized == 32 * ((c[0].offset - 64) // 32) and c[0].flushes > 0


def test_generation_with_vqpipe_weights(tiny, tiny_b4_reservoir):
    from vqpipe.store.reservoir import load as load_reservoir

    model, _ = load_reservoir(tiny_b4_reservoir)
    _, tokenizer = tiny  # the source's tokenizer
    prompt = _prompt(tokenizer, 150)
    ref = _tokens(model, tokenizer, prompt, make_kivi_cache(model, 4, 32, 32, packed=False), n=8)
    assert _tokens(model, tokenizer, prompt, make_kivi_cache(model, 4, 32, 32, packed=True), n=8) == ref


# --- the decode kernel's CUDA source, run on the host ---------------------------------------------

# (dtype, bits, G, D, KV heads, GQA ratio, tokens, residual length, warps, splits)
HOST_CASES = [
    ("float32", 4, 32, 64, 1, 1, 300, 40, 1, [1, 5]),
    ("float32", 2, 32, 128, 2, 4, 333, 17, 4, [1, 3, 64]),
    ("float32", 8, 32, 64, 4, 2, 200, 0, 2, [2, 7]),
    ("float32", 4, 64, 128, 8, 8, 170, 33, 8, [1, 4]),
    ("float32", 2, 32, 64, 2, 3, 95, 128, 2, [1, 2]),  # nothing quantized: the residual alone, ragged
    ("float32", 4, 32, 128, 1, 5, 260, 96, 8, [3]),
    ("float32", 8, 32, 128, 2, 6, 150, 20, 2, [1, 6]),
    ("float32", 4, 32, 64, 2, 7, 129, 1, 4, [2]),
    ("float16", 4, 32, 128, 8, 4, 300, 128, 8, [1, 9]),
    ("bfloat16", 2, 64, 64, 2, 2, 250, 32, 4, [5]),
]


@pytest.fixture(scope="module")
def host_attn(tmp_path_factory):
    combos = sorted({(dt, b, g, d, r, w, pf) for dt, b, g, d, _, r, _, _, w, _ in HOST_CASES for pf in (0, 1)})
    exe = kivi_host.build(tmp_path_factory.mktemp("kivi_attn_host"), combos)
    if exe is None:
        pytest.skip("no C++ compiler for the host run of the CUDA rendering")
    return exe


@pytest.mark.parametrize("case", HOST_CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_cuda_rendering_on_host_within_float32_bound(host_attn, case):
    dt, bits, g, d, hk, ratio, s, res, warps, splits = case
    k, v = _kv(1, hk, s, d, dt, seed=s)
    c = _filled(bits, g, res, k, v, [s - 1, 1])
    assert c.quantized == max(0, (s - res) // g * g)
    q = (mx.random.normal((1, hk * ratio, 1, d), key=mx.random.key(s)) * 1.5).astype(getattr(mx, dt))
    outs = []
    # every split count with the loads a chunk ahead, the first also without
    for ns, ahead in [(ns, 1) for ns in splits] + [(splits[0], 0)]:
        out, counters = kivi_host.run(host_attn, q, c, d**-0.5, ns, warps, seed=ns + 1, ahead=ahead)
        assert not counters.any(), "the last block resets its counter"
        assert_within(out, q, c, d**-0.5, None, f"splits {ns} ahead {ahead}")
        outs.append(np.array(out.astype(mx.float32)))
    want, tol = reference(q, c, d**-0.5)
    assert all(np.all(np.abs(o - outs[0]) <= 2 * tol + 2 * _ulp(want, dt)) for o in outs)


def test_decode_kernel_source_one_description_two_dialects():
    (nc, hc, bc), (nm, hm, bm) = decode_kernel.render("cuda"), decode_kernel.render("metal")
    assert "KA_" not in bc + bm and nc != nm and nc.startswith("kivi_decode_attn_")
    assert "__shfl_xor_sync" in hc and "__ldcg" in hc and "atomicAdd" in hc
    assert "simd_shuffle" in hm and "atomic_fetch_add_explicit" in hm
    # every version's body uses the same tokens, which both dialects give, and the same helpers
    bodies = decode_kernel._BODY_V3 + decode_kernel._BODY + "".join(decode_kernel._COUNTS.values())
    used = set(re.findall(r"\bKA_[A-Z0-9_]+\b", bodies))
    assert all(set(d["tokens"]) == used for d in decode_kernel.DIALECTS.values())
    helpers = lambda h: sorted(set(re.findall(r"\b(ka_[a-z_]+)\(", h)))  # noqa: E731
    assert helpers(hc) == helpers(hm) == helpers(bodies)
    names = {decode_kernel.render("cuda", v)[0] for v in decode_kernel.VERSIONS}
    assert len(names) == len(decode_kernel.VERSIONS) and nc == decode_kernel.render("cuda", decode_kernel.VERSION)[0]
    # the launch's two ways of passing scale and counts are two kernels; the default reads 8 bytes
    small, float3 = (decode_kernel.render("cuda", None, m) for m in ("small", "float3"))
    assert small[0] == nc != float3[0] and "SCALE_BITS" in small[2] and "meta[2]" in float3[2] and "meta[2]" not in small[2]
    # what MLX gets is minified (it rebuilds the source string every call): no comments, no indentation
    assert "//" not in hc + bc and not any(line.startswith(" ") for line in (hc + bc).splitlines())
    # launch bounds ride in the CUDA header (MLX writes "__global__ void name(...)" after it)
    bounded = decode_kernel.render("cuda", "v3", None, 8, 3)
    assert bounded[1].startswith("#undef __global__\n#define __global__ __location__(global) __launch_bounds__(256, 3)\n")
    assert bounded[0] != nc and bounded[2] == bc and decode_kernel.render("metal", "v3", None, 8, 3) == (nm, hm, bm)


def test_launch_shape_per_bit_width():
    """The default launch per kernel version and bit width; splits from the chunks each warp takes;
    v3's template carries its loads-ahead flag."""
    k, v = _kv(1, 2, 4133, 128, "float16")
    q = mx.zeros((1, 8, 1, 128), mx.float16)
    for bits in (2, 4):
        c = _filled(bits, 32, 128, k, v, [4132, 1])
        chunks = c.quantized // 32 + -(-c.nres // 32)
        for version in decode_kernel.VERSIONS:
            shape = decode_kernel.default_shape(bits, version)
            _, spec, got = decode_kernel.launch_args(q, c, 0.1, version=version)
            assert got == shape._replace(version=version) and spec["threadgroup"] == (shape.warps * 32, 1, 1)
            ns = decode_kernel.default_splits(chunks, shape.warps, shape.per_warp, 2, decode_kernel.resident_blocks(bits, shape))
            assert spec["grid"] == (ns * shape.warps * 32, 2, 1)
            assert ("PF", shape.ahead) in spec["template"] if version == "v3" else "PF" not in dict(spec["template"])
        assert decode_kernel.default_shape(bits, "v2")[:4] == ((4, 2, 0, 0) if bits == 2 else (8, 4, 0, 0))
        _, fixed, shape = decode_kernel.launch_args(q, c, 0.1, splits=3, warps=2, ahead=0, minblocks=5)
        assert fixed["grid"] == (3 * 64, 2, 1) and fixed["threadgroup"] == (64, 1, 1)
        assert shape == (2, decode_kernel.CHUNKS_PER_WARP, 0, 5, "v3") and ("PF", 0) in fixed["template"]


def test_launch_inputs_scale_counts_and_scratch_slots():
    """The default launch hands over 8 bytes of counts (MLX's small pool) and the scale's exact
    float32 bits; the scratch holds a power of two of partials >= the splits, grown, never shrunk."""
    k, v = _kv(1, 2, 700, 128, "float16")
    c = _filled(4, 32, 128, k, v, [699, 1])
    q = mx.zeros((1, 8, 1, 128), mx.float16)
    inputs, spec, _ = decode_kernel.launch_args(q, c, 128**-0.5, splits=3)
    counts = inputs[decode_kernel.INPUTS.index("meta")]
    assert counts.nbytes == 8 and counts.tolist() == [c.quantized, c.nres]
    bits = dict(spec["template"])["SCALE_BITS"]
    assert np.array([bits], np.int32).view(np.float32)[0] == np.float32(128**-0.5)
    assert c.scratch[0].shape == (2, 8, 4 * 130)
    decode_kernel.launch_args(q, c, 0.1, splits=9)
    assert c.scratch[0].shape[1] == 16
    decode_kernel.launch_args(q, c, 0.1, splits=2)
    assert c.scratch[0].shape[1] == 16
    decode_kernel.launch_args(q, c, 0.1, splits=decode_kernel.NSMAX)
    assert c.scratch[0].shape[1] == decode_kernel.NSMAX
    old, spec3, _ = decode_kernel.launch_args(q, c, 0.25, splits=3, meta="float3")
    assert old[7].tolist() == [0.25, c.quantized, c.nres] and "SCALE_BITS" not in dict(spec3["template"])


def test_launch_keywords_kept_while_they_hold():
    """The launch keywords are kept on the cache and rebuilt when anything they follow changes."""
    k, v = _kv(1, 2, 700, 128, "float16")
    c = _filled(4, 32, 128, k, v, [699, 1])
    q = mx.zeros((1, 8, 1, 128), mx.float16)
    _, spec, _ = decode_kernel.launch_args(q, c, 0.1)
    assert decode_kernel.launch_args(q, c, 0.1)[1] is spec
    other = decode_kernel.launch_args(q, c, 0.2)[1]
    assert other is not spec and dict(other["template"])["SCALE_BITS"] == decode_kernel.scale_bits(0.2)
    assert decode_kernel.launch_args(q, c, 0.2, version="v2")[1]["template"] != other["template"]
    before = decode_kernel.launch_args(q, c, 0.1, warps=2)[1]["grid"]
    c.update_and_fetch(k[:, :, :200], v[:, :, :200])
    inputs, grown, shape = decode_kernel.launch_args(q, c, 0.1, warps=2)
    chunks = c.quantized // 32 + -(-c.nres // 32)
    assert grown["grid"][0] == decode_kernel.default_splits(chunks, shape.warps, shape.per_warp) * shape.warps * 32 != before[0]
    assert inputs[decode_kernel.INPUTS.index("meta")].tolist() == [c.quantized, c.nres]
    assert c.scratch[0].shape[1] >= grown["grid"][0] // (shape.warps * 32)


def test_kernel_geometry_limits():
    assert decode_kernel.unsupported(128, 128, 4, 32, 4) is None
    assert decode_kernel.unsupported(128, 128, 2, 32, 8) is None
    assert "group_size" in decode_kernel.unsupported(128, 128, 4, 16, 4)
    assert "head dim" in decode_kernel.unsupported(96, 96, 4, 32, 4)
    assert "query heads" in decode_kernel.unsupported(64, 64, 4, 32, 9)
    assert "different head dims" in decode_kernel.unsupported(64, 128, 4, 32, 2)


# --- kernel v4 (tensor cores): its numpy model on the CPU, its host-side pieces ------------------

V4_SPLIT = 2.0**-16  # the hi + lo operands' relative error each (bf16: 2^-8 of 2^-8)


def test_bf16_hi_lo_split_error_is_within_2_to_minus_16():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-30, 30, 200_000))).astype(np.float32)
    hi, lo = kivi_v4_model.split(x)
    err = np.abs(x.astype(np.float64) - hi.astype(np.float64) - lo.astype(np.float64))
    assert np.all(err <= V4_SPLIT * np.abs(x.astype(np.float64)))
    assert np.max(err / np.abs(x)) > V4_SPLIT / 4  # the bound is nearly reached: 2^-16 is the right term
    # codes: bf16(128 + c) - 128 is c for every 2- and 4-bit code
    for bits in (2, 4):
        for c0, c1 in itertools.product(range(2**bits), repeat=2):
            assert kivi_v4_model.pair(c0 | (c1 << 16), bits) == (c0, c1)


def _v4_model(cache, q, scale, splits, warps):
    """The model's answer: the chunks (quantized, then the residual's) cut into ``splits`` runs
    (blocks) of ``warps`` interleaved warps, as the kernel assigns them, the partials merged in float64."""
    rkb, rvb, nr = cache.residual_buffers()
    b, h = rkb.shape[:2]
    d, bits, g, nq = q.shape[-1], cache.kv_bits, cache.group_size, cache.quantized
    r = q.shape[1] // h
    if cache.kc is None:  # nothing quantized: stand-ins no chunk reads (as launch_args passes)
        kc, vc = np.zeros((b, h, 1, d * bits // 32, g), np.uint32), np.zeros((b, h, 0, d * bits // 32), np.uint32)
        kp, vp = np.zeros((b, h, 1, d), np.uint32), np.zeros((b, h, 0, -(-d // g)), np.uint32)
    else:
        kc, vc = np.array(cache.kc), np.array(cache.vc)
        kp = np.array(cache.kp.astype(mx.float16)).view(np.uint32)[..., 0]
        vp = np.array(cache.vp.astype(mx.float16)).view(np.uint32)[..., 0]
    rk, rv = (np.array(a.astype(mx.float32)) for a in (rkb, rvb))
    qn = np.array(q.astype(mx.float32)).reshape(b, h, r, d)
    out = np.zeros((b, h, r, d))
    nc = nq // 32 + -(-nr // 32)
    per = -(-nc // splits)
    for bi, hi in itertools.product(range(b), range(h)):
        parts = []
        for sp in range(splits):
            for w in range(warps):
                chunks = list(range(sp * per + w, min(nc, sp * per + per), warps))
                if chunks:
                    parts.append(kivi_v4_model.tc_partial(qn[bi, hi], scale, kc[bi, hi], kp[bi, hi], vc[bi, hi], vp[bi, hi],
                                                          chunks, bits, g, rk[bi, hi], rv[bi, hi], nr, nq))
        mm = np.max([p[0] for p in parts], axis=0)
        wts = [np.exp(p[0].astype(np.float64) - mm) for p in parts]
        num = sum(wt[:, None] * p[2] for wt, p in zip(wts, parts))
        out[bi, hi] = num / sum(wt * p[1] for wt, p in zip(wts, parts))[:, None]
    return out.reshape(b, h * r, 1, d)


# (bits, G, D, KV heads, GQA ratio, tokens, residual length, splits x warps, dtype): 1/2 KV heads,
# GQA 1-8, D 64/128, 2/4 bits, G 32/64/128, one chunk per warp up to several, residuals of 1 to 5
# chunks (ragged, and the residual alone), float32 residuals (their keys and values split too)
V4_MODEL_CASES = [
    (4, 32, 128, 1, 4, 160, 40, [(1, 4), (3, 1), (2, 2)], "float16"),
    (2, 32, 128, 2, 8, 96, 4, [(1, 1), (2, 4)], "float16"),
    (4, 64, 64, 1, 1, 256, 70, [(1, 4), (4, 1)], "float16"),
    (2, 32, 64, 1, 7, 128, 33, [(1, 2)], "float16"),
    (4, 128, 64, 2, 3, 288, 4, [(1, 4), (2, 3)], "float16"),
    (2, 64, 128, 1, 5, 128, 100, [(1, 4)], "float16"),
    (4, 32, 64, 1, 2, 64, 1, [(1, 1)], "float16"),
    (4, 32, 128, 1, 6, 64, 32, [(2, 1)], "float16"),
    (4, 32, 64, 1, 4, 20, 128, [(1, 1)], "float16"),  # nothing quantized: the residual alone
    (2, 32, 64, 1, 4, 64, 40, [(1, 2), (2, 1)], "float32"),
]


def v4_split(dtype):
    """v4's split term: the query and p as hi + lo (2^-16 each); a float32 residual's keys and values
    are split as well, another 2^-16 (float16 and bfloat16 split exactly)."""
    return V4_SPLIT * (2.01 if dtype == "float32" else 1.0)


@pytest.mark.parametrize("case", V4_MODEL_CASES, ids=lambda c: "-".join(map(str, c[:7] + (c[8],))))
def test_v4_model_within_float32_bound_plus_split_term(case):
    bits, g, d, hk, ratio, s, res, shapes, dt = case
    k, v = _kv(1, hk, s + 7, d, dt, seed=s + d + bits)
    c = _filled(bits, g, res, k, v, [s + 7])
    assert c.nres >= min(res, s + 7) and (c.quantized > 0) == (s + 7 >= res + g)
    q = (mx.random.normal((1, hk * ratio, 1, d), key=mx.random.key(s)) * 1.5).astype(getattr(mx, dt))
    want, tol = reference(q, c, d**-0.5, split=v4_split(dt))
    _, tol0 = reference(q, c, d**-0.5)
    outs = []
    for ns, nw in shapes:
        got = _v4_model(c, q, d**-0.5, ns, nw)
        err = np.abs(got - want)
        assert np.all(err <= tol), f"splits {ns} warps {nw}: ratio {np.max(err / tol):.3g}"
        outs.append(got)
    assert all(np.all(np.abs(o - outs[0]) <= 2 * tol) for o in outs)
    # the split term is what the bound needs: without it the model may exceed the float32 bound,
    # with it the error stays under (this records how close; no assertion on the first)
    print(f"{case[:7]}: worst error / float32 bound {np.max(np.abs(outs[0] - want) / tol0):.3g}, / v4 bound {np.max(np.abs(outs[0] - want) / tol):.3g}")


def test_v4_covers_2_and_4_bits_and_falls_back_to_v3():
    pick = decode_kernel.pick_version
    assert pick("v4", 128, 128, 4, 32, 4, dialect="cuda") == "v4"
    assert pick("auto", 128, 128, 2, 32, 8, dialect="cuda") == "v4"
    assert pick("auto", 64, 64, 2, 32, 7, dialect="cuda") == "v4"
    assert pick("auto", 128, 128, 4, 32, 4, dialect="metal") == "v3"  # CUDA only
    assert pick("auto", 128, 128, 4, 32, 4, dialect=None) == "v3"  # no GPU: the host rendering's v3
    assert pick("v4", 128, 128, 8, 32, 4, dialect="cuda") == "v3"  # 8 bits: bf16(128 + c) needs c < 128
    assert "8-bit" in decode_kernel.v4_unsupported(128, 128, 8, 32, 4)
    assert "head dim" in decode_kernel.v4_unsupported(96, 96, 4, 32, 4)
    assert "shared memory" in decode_kernel.v4_unsupported(128, 128, 4, 32, 4, warps=8)
    assert pick("v4", 128, 128, 4, 32, 4, warps=8, dialect="cuda") == "v3"
    assert pick("v2", 128, 128, 4, 32, 4, dialect="cuda") == "v2"
    # v4r, the seventh window's v4 (residual on CUDA cores, a second partial per warp), by name only
    assert pick("v4r", 128, 128, 4, 32, 4, dialect="cuda") == "v4r" and pick("v4r", 128, 128, 8, 32, 4, dialect="cuda") == "v3"
    assert decode_kernel.parse_shape("4xf:v4r").version == "v4r"
    assert decode_kernel.resident_blocks(4, decode_kernel.default_shape(4, "v4r")) == 2
    assert decode_kernel.shared_floats(128, 4, 4, 32, "v4r", 4) >= 2 * 4 * 4 * 130 > decode_kernel.shared_floats(128, 4, 1, 32, "v4", 4)
    v4r = decode_kernel.render("cuda", "v4r", minify=False)[2]
    v4 = decode_kernel.render("cuda", "v4", minify=False)[2]
    v4m = decode_kernel.render("cuda", "v4m", minify=False)[2]
    assert "qres" in v4r and "qres" not in v4 and "kv4_ld4(rv" in v4 and "w < 2u * NW;" in v4r and "w < 2u * NW;" not in v4
    assert "qres" in v4m and "w < 2u * NW;" in v4m and "V4O" in v4m and "V4O" in v4 and "V4O" not in v4r
    with pytest.raises(ValueError, match="CUDA only"):
        decode_kernel.render("metal", "v4r")
    with pytest.raises(ValueError, match="CUDA only"):
        decode_kernel.render("metal", "v4")
    name, header, body = decode_kernel.render("cuda", "v4")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in header and "cp.async" in header
    assert decode_kernel.parse_shape("4xf:v4") == decode_kernel.Shape(4, 0, 0, 0, "v4")
    assert decode_kernel.shape_text(decode_kernel.parse_shape("4x2:pf0:mb0:v4")) == "4x2:pf0:mb0:v4"
    assert decode_kernel.resident_blocks(4, decode_kernel.V4_SHAPE) == 2
    c = PackedKIVICache(4, 32, 128)
    k, v = _kv(1, 8, 4133, 128, "float16")
    c.update_and_fetch(k, v)
    _, spec, shape = decode_kernel.launch_args(mx.zeros((1, 32, 1, 128), mx.float16), c, 0.1, version="v4")
    assert shape.version == "v4" and spec["threadgroup"] == (128, 1, 1)
    assert ("PF", 0) not in spec["template"] and ("NW", 4) in spec["template"]


# --- GPU: the kernel itself ------------------------------------------------------------------------


# (dtype, bits, G, D, KV heads, GQA ratio, tokens, residual length, warps): each distinct
# (dtype, bits, G, D, ratio, warps) is one JIT compile (about 4 s), so the list spans the factors
# with few; the host run above covers every GQA ratio 1-8 and warp counts 1-8.
GPU_CASES = [
    ("float16", 4, 32, 128, 8, 4, 4133, 128, 8),  # the benchmark's geometry
    ("float16", 2, 32, 128, 8, 4, 1000, 17, 8),
    ("float16", 8, 32, 128, 8, 4, 300, 0, 8),
    ("float16", 4, 32, 128, 4, 4, 37, 128, 4),  # the residual alone, ragged
    ("bfloat16", 4, 32, 128, 1, 1, 300, 17, 8),
    ("bfloat16", 4, 32, 128, 4, 3, 4133, 128, 8),
    ("bfloat16", 4, 32, 128, 8, 5, 300, 128, 8),
    ("bfloat16", 4, 32, 128, 4, 8, 4133, 17, 8),
    ("float16", 2, 32, 64, 2, 7, 4133, 128, 8),  # qwen2.5-0.5b's geometry
    ("bfloat16", 8, 32, 64, 8, 2, 1000, 17, 8),
    ("float32", 2, 64, 128, 2, 8, 1000, 128, 8),
    ("bfloat16", 4, 32, 64, 2, 2, 4133, 64, 8),  # synth:tiny's geometry
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_within_float32_bound_for_every_split_count(case):
    dt, bits, g, d, hk, ratio, s, res, warps = case
    k, v = _kv(1, hk, s, d, dt, seed=s + d)
    c = _filled(bits, g, res, k, v, [s - 1, 1])
    q = (mx.random.normal((1, hk * ratio, 1, d), key=mx.random.key(s)) * 1.5).astype(getattr(mx, dt))
    want, tol = reference(q, c, d**-0.5)
    outs = []
    for ns in (None, 1, 3, 7, decode_kernel.NSMAX):
        out = decode_kernel.decode_attention(q, c, d**-0.5, splits=ns, warps=warps, version="v3")
        again = decode_kernel.decode_attention(q, c, d**-0.5, splits=ns, warps=warps, version="v3")  # the same scratch, reset
        assert_within(out, q, c, d**-0.5, None, f"splits {ns} warps {warps}")
        assert mx.array_equal(out, again)
        outs.append(np.array(out.astype(mx.float32)))
    assert all(np.all(np.abs(o - outs[0]) <= 2 * tol + 2 * _ulp(want, dt)) for o in outs)
    # two launches on one cache in one graph (they share its scratch): ordered, the same answer
    a, b = decode_kernel.decode_attention(q, c, d**-0.5), decode_kernel.decode_attention(q, c, d**-0.5)
    assert mx.array_equal(a, b)
    # the second window's launch (scale and counts as 12 bytes of float32): the same arithmetic
    assert mx.array_equal(decode_kernel.decode_attention(q, c, d**-0.5, meta="float3"), a)
    # v3 with the loads not ahead, with registers capped (spilling), and the second window's v2:
    # the same sums in other orders
    for kw in ({"version": "v3", "ahead": 0}, {"version": "v3", "ahead": 1, "minblocks": 2}, {"version": "v2"}):
        other = decode_kernel.decode_attention(q, c, d**-0.5, warps=warps, **kw)
        assert_within(other, q, c, d**-0.5, None, f"{kw} warps {warps}")
        assert np.all(np.abs(np.array(other.astype(mx.float32)) - outs[0]) <= 2 * tol + 2 * _ulp(want, dt))
    # through the dispatch, as mlx-lm's attention reaches it
    assert decode_kernel.applies(q, c)
    assert mx.array_equal(attention.attend(q, c, d**-0.5, None), decode_kernel.decode_attention(q, c, d**-0.5))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_v4_within_its_bound_for_every_split_count_and_block_size(case):
    """Kernel v4 against float64 within the float32 bound plus the hi + lo term (V4_SPLIT), for
    splits default/1/3/7/128 and 4-warp blocks (also 1 and 2 warps on the first and the qwen case);
    a geometry v4 does not serve (8 bits) runs v3 and the test says so."""
    dt, bits, g, d, hk, ratio, s, res, _ = case
    k, v = _kv(1, hk, s, d, dt, seed=s + d)
    c = _filled(bits, g, res, k, v, [s - 1, 1])
    q = (mx.random.normal((1, hk * ratio, 1, d), key=mx.random.key(s)) * 1.5).astype(getattr(mx, dt))
    why = decode_kernel.v4_unsupported(d, d, bits, g, ratio)
    if why:
        v3 = decode_kernel.decode_attention(q, c, d**-0.5, version="v3")
        assert decode_kernel.launch_args(q, c, d**-0.5, version="v4")[2].version == "v3"
        assert mx.array_equal(decode_kernel.decode_attention(q, c, d**-0.5, version="v4"), v3)
        assert mx.array_equal(attention.attend(q, c, d**-0.5, None), v3)
        warnings.warn(f"{case}: v4 does not serve it ({why}); v3 ran")
        return
    split = v4_split(dt)
    want, tol = reference(q, c, d**-0.5, split=split)
    outs = []
    warp_counts = (4, 1, 2) if case in (GPU_CASES[0], GPU_CASES[8]) else (4,)
    for nw, ns in itertools.product(warp_counts, (None, 1, 3, 7, decode_kernel.NSMAX)):
        out = decode_kernel.decode_attention(q, c, d**-0.5, splits=ns, warps=nw, version="v4")
        again = decode_kernel.decode_attention(q, c, d**-0.5, splits=ns, warps=nw, version="v4")
        assert_within(out, q, c, d**-0.5, None, f"v4 splits {ns} warps {nw}", split=split)
        assert mx.array_equal(out, again)
        outs.append(np.array(out.astype(mx.float32)))
    assert all(np.all(np.abs(o - outs[0]) <= 2 * tol + 2 * _ulp(want, dt)) for o in outs)
    v3 = np.array(decode_kernel.decode_attention(q, c, d**-0.5, version="v3").astype(mx.float32))
    assert np.all(np.abs(v3 - outs[0]) <= 2 * tol + 2 * _ulp(want, dt))
    # v4r (the seventh window's v4: the residual on CUDA cores, v3's merge), kept to be timed against
    # and v4m (v4r with v4's final merge)
    for ver, ns in itertools.product(("v4r", "v4m"), (None, 7)):
        old = decode_kernel.decode_attention(q, c, d**-0.5, splits=ns, version=ver)
        assert_within(old, q, c, d**-0.5, None, f"{ver} splits {ns}", split=V4_SPLIT)
        assert np.all(np.abs(np.array(old.astype(mx.float32)) - outs[0]) <= 2 * tol + 2 * _ulp(want, dt))
    # "auto" (the default) on CUDA takes v4 here
    if kernels.backend() == "cuda":
        assert decode_kernel.launch_args(q, c, d**-0.5, version="auto")[2].version == "v4"
        assert mx.array_equal(decode_kernel.decode_attention(q, c, d**-0.5, version="auto"),
                              decode_kernel.decode_attention(q, c, d**-0.5, version="v4"))


@pytest.mark.gpu
@needs_gpu
def test_kernel_dispatch_and_generation(tiny):
    model, tokenizer = tiny
    prompt = _prompt(tokenizer, 400)
    c = make_kivi_cache(model, 4, 32, 64, packed=True)
    q = mx.random.normal((1, 4, 1, 64)).astype(mx.bfloat16)
    mx.eval(_tokens(model, tokenizer, prompt, c, n=2))
    assert decode_kernel.applies(q, c[0])
    on = _tokens(model, tokenizer, prompt, make_kivi_cache(model, 4, 32, 64, packed=True), n=24)
    off = _tokens(model, tokenizer, prompt, make_kivi_cache(model, 4, 32, 64, use_kernels=False, packed=True), n=24)
    same = next((i for i, (a, b) in enumerate(zip(on, off)) if a != b), len(on))
    if same < len(on):
        warnings.warn(f"kernel and tile-path decode differ from token {same} (float32 sums in another order)")
    assert same >= 8, (on, off)


def test_bench_kivi_attn_quick_runs_every_part(tmp_path, monkeypatch):
    """bench-kivi-attn --quick on CPU, the fused kernel stood in for by the tile path, so every
    part's arms, floors and fields are exercised without a GPU."""
    import json

    from experiments import bench_kivi_attn

    monkeypatch.setattr(decode_kernel, "active", lambda use_kernels=None: use_kernels is not False)
    def stand_in(q, c, scale, **kw):  # the tile path; a launch-bounds variant "fails to compile"
        if kw.get("minblocks") == 5:
            raise RuntimeError("nvrtc: stand-in compile error")
        return attention.attend_tiles(q, c, scale)

    monkeypatch.setattr(decode_kernel, "decode_attention", stand_in)
    out = tmp_path / "a.json"
    assert bench_kivi_attn.main(["--out", str(out), "--quick", "--variants", "2x1,v2:8x2,v3:4x2:pf1:mb3,v3:8x2:mb5",
                                 "--work", str(tmp_path / "m")]) == 0
    doc = json.loads(out.read_text())
    (op,) = doc["op"]
    variants = {f"kivi{b}:{v}" for b in (4, 2) for v in ("v2:w2c1", "v2:w8c2", "v3:w4c2pf1mb3")}
    assert set(op["failed_arms"]) == {"kivi4:v3:w8c2pf0mb5", "kivi2:v3:w8c2pf0mb5"}
    assert set(op["arms"]) == {"fp16-sdpa", "mlx-q4", "kivi4", "kivi2"} | variants and op["noise_floor"] >= 0
    assert set(op["kernel_vs_tiles_max_abs"]) == {"kivi4", "kivi2"} | variants
    assert all(v > 0 for v in op["build_seconds_per_layer"].values())
    assert op["arms"]["kivi4"]["vs_mlx_q4"] > 0 and all(v < 1e-5 for v in op["kernel_vs_tiles_max_abs"].values())
    mem = doc["memory"]["tiny"]
    assert mem["kivi4"]["cache_nbytes"] < mem["fp16"]["cache_nbytes"] and mem["kivi2"]["packed_nbytes"] > 0
    (dec,) = doc["decode"]
    assert {"fp16", "kivi4", "kivi2"} <= set(dec["arms"]) and dec["arms"]["kivi4"]["tok_per_s_median"] > 0
    assert bench_kivi_attn.amdahl(10.0, 32, 0.1, 0.05) == pytest.approx(10 / 8.4)
    assert bench_kivi_attn._variants("v3:8x2:pf1") == [("v3", decode_kernel.Shape(8, 2, 1, 0))]
    for bad in ("v3:8", "v3:8x2:pf2", "v9:8x2", "8x2:zz1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_kivi_attn._variants(bad)
    # the KV-side memory part: every kind's peak and sizes, packed caches against their theory
    assert bench_kivi_attn.main(["--out", str(out), "--quick", "--parts", "kvmemory"]) == 0
    kv = json.loads(out.read_text())["kv_memory"]
    assert kv["fp16"]["peak_bytes"] > kv["fp16"]["cache_nbytes"] > kv["kivi4"]["cache_nbytes"] > kv["kivi2"]["cache_nbytes"]
    assert all(1 <= kv[k]["nbytes_vs_packed"] < 1.5 for k in ("kivi4", "kivi2")) and kv["fp16"]["packed_nbytes"] is None


def test_bench_kivi_floor_prefill_part_runs_on_cpu(tmp_path):
    """The launch probe's arms need CUDA (skipped here, said so); its prefill part runs anywhere."""
    from experiments import kivi_floor as bench_kivi_floor

    out = tmp_path / "floor.json"
    assert bench_kivi_floor.main(["--out", str(out), "--prefill", "300", "--chunk", "32", "--scores", "16",
                                  "--prefill-repeats", "1"]) == 0
    import json

    d = json.loads(out.read_text())
    assert d["op"] == [] and {(r["model"], r["bits"]) for r in d["prefill"]} == {
        (m, b) for m in ("llama3-8b", "qwen2.5-0.5b") for b in (4, 2)}
    assert all(r["seconds"]["n"] == 1 and r["transient_peak_bytes"] > 0 for r in d["prefill"])
    assert attention.SCORES == 1 << 23  # restored
    with pytest.raises(SystemExit):
        bench_kivi_floor.parse_args(["--out", "x", "--arms", "sdpa,nope"])


def test_whole_book_text_holds_both_splits():
    from vqpipe import text

    whole = text.text("all")
    assert len(whole) == len(text.text("eval")) + len(text.text("calibration")) + 2  # one more separator
    assert whole.startswith(text.entries()[0][1])


def test_fill_splits_one_wave_over_the_gpu(monkeypatch):
    """'WxF' shapes: as many splits as one wave of resident blocks over every SM needs, each warp
    keeping at least one chunk, at most NSMAX; the text form round-trips."""
    monkeypatch.setattr(decode_kernel, "multiprocessors", lambda: 132)
    assert decode_kernel.multiprocessors() == 132
    sh = decode_kernel.parse_shape("8xf")
    assert sh == decode_kernel.Shape(8, 0, 0, 0) and decode_kernel.shape_text(sh) == "8xf:pf0:mb0"
    assert decode_kernel.parse_shape(decode_kernel.shape_text(decode_kernel.Shape(4, 3, 1, 5))) == (4, 3, 1, 5, "")
    # 8k at the 8B geometry: 260 chunks, 8 KV heads; 128 registers: 16 resident warps per SM
    assert decode_kernel.default_splits(260, 8, 0, 8) == 33  # 264 blocks of 8 warps = 2 per SM
    assert decode_kernel.default_splits(260, 4, 0, 8) == 65  # 520 blocks of 4 warps = 4 per SM
    r = decode_kernel.resident_blocks
    assert (r(4, sh), r(4, decode_kernel.Shape(4, 0)), r(2, decode_kernel.Shape(4, 0, 1)), r(2, decode_kernel.Shape(8, 0))) == (2, 4, 3, 1)
    assert r(2, decode_kernel.Shape(8, 0, 0, 3)) == 3  # launch bounds decide
    assert decode_kernel.default_splits(260, 4, 0, 8, 3) == 50  # 2 bits, 4 warps: 396 slots
    assert decode_kernel.default_splits(260, 8, 4) == 9  # the throughput shape: 72 blocks
    assert decode_kernel.default_splits(40, 8, 0, 8) == 5  # at least one chunk per warp
    assert decode_kernel.default_splits(10**6, 1, 0, 1) == decode_kernel.NSMAX
    with pytest.raises(ValueError, match="KV heads"):
        decode_kernel.default_splits(260, 8, 0)
    k, v = _kv(1, 2, 4133, 128, "float16")
    c = _filled(4, 32, 128, k, v, [4132, 1])
    _, spec, shape = decode_kernel.launch_args(mx.zeros((1, 8, 1, 128), mx.float16), c, 0.1, warps=4)
    assert spec["grid"][0] == decode_kernel.default_splits(130, 4, shape.per_warp) * 128
    monkeypatch.setitem(decode_kernel.V3_SHAPES, 4, sh)
    _, spec, shape = decode_kernel.launch_args(mx.zeros((1, 8, 1, 128), mx.float16), c, 0.1)
    assert shape == sh._replace(version="v3") and spec["grid"][0] == min(-(-132 * 2 // 2), -(-130 // 8)) * 256
    for bad in ("8xg", "8x-1", "0xf"):
        with pytest.raises(ValueError):
            decode_kernel.parse_shape(bad)


def test_bench_kivi_latency_on_cpu(tmp_path, monkeypatch):
    """bench-kivi-latency on CPU with the tile path standing in for the kernel: every context's arms
    in one interleave, a floor per context, the split table; skipped cleanly without a kernel."""
    import json

    from experiments import kivi_latency

    out = tmp_path / "lat.json"
    assert kivi_latency.main(["--out", str(out), "--contexts", "256", "--layers", "1"]) == 0
    assert "rows" not in json.loads(out.read_text())  # no kernel here: said so, nothing timed
    monkeypatch.setattr(decode_kernel, "active", lambda use_kernels=None: use_kernels is not False)
    monkeypatch.setattr(decode_kernel, "decode_attention", lambda q, c, scale, **kw: attention.attend_tiles(q, c, scale))
    for extra in ([], ["--sequential"]):
        assert kivi_latency.main(["--out", str(out), "--contexts", "256,300", "--layers", "2", "--inputs", "2", "--repeats", "2",
                                  "--warmup", "1", "--shapes", "default,4/4xf,2/8x2:pf1,4/v4,4/v4r"] + extra) == 0
        d = json.loads(out.read_text())
        assert [r["S"] for r in d["rows"]] == [256, 300] and not d["failed"]
        arms = set(d["rows"][0]["arms"])
        assert {"sdpa", "sdpa-chain", "sdpa-vchain", "sdpa-vchain (A/A)", "kivi4@8xf:pf0:mb0", "kivi4-chain@4xf:pf0:mb0",
                "kivi2@4xf:pf1:mb0", "kivi2-chain@8x2:pf1:mb0", "kivi4-chain@4xf:pf0:mb0:v4",
                "kivi4-chain@4xf:pf0:mb0:v4r"} <= arms and "kivi2@4xf:pf0:mb0" not in arms
        assert d["rows"][1]["splits"]["kivi4@4xf:pf0:mb0"]["blocks"] % 8 == 0
        assert all(a["total"]["n"] == 2 and a["total"]["median"] > 0 for a in d["rows"][0]["arms"].values())


def test_bench_kivi_attn_compiled_decode_arms(tmp_path):
    """bench-kivi-attn's decode part with --compiled: fp16 through decode_step's split mode and each
    KIVI width through the compiled step, beside the eager arms (CPU: the tile path)."""
    import json

    from experiments import bench_kivi_attn

    out = tmp_path / "d.json"
    assert bench_kivi_attn.main(["--out", str(out), "--quick", "--parts", "decode", "--compiled", "--work", str(tmp_path / "m")]) == 0
    (dec,) = json.loads(out.read_text())["decode"]
    assert set(dec["arms"]) == {"fp16", "kivi4", "kivi2", "fp16+s", "kivi4+c", "kivi2+c"}
    assert all(dec["compiled_steps"][k]["compiled"] >= 1 for k in ("kivi4", "kivi2"))
