"""The compiled decode step over packed KIVI caches (vqpipe/kivi/compiled.py): the same greedy
tokens and logits as eager decode through the same caches, flush steps eager, few traces. On the
CPU attention takes the tile path over the masked residual buffer; on a GPU (``gpu``) the kernel."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from vqpipe.kivi import kernels
from vqpipe.kivi.cache import make_kivi_cache
from vqpipe.kivi.compiled import KIVIDecoder

CORPUS = Path(__file__).parents[1] / "vqpipe" / "data" / "corpus.txt"
needs_gpu = pytest.mark.skipif(kernels.backend() is None, reason="needs MLX's Metal or CUDA backend")


@pytest.fixture(scope="module")
def tiny(tiny_source):
    model, tokenizer = load(str(tiny_source))
    model.set_dtype(mx.float32)  # float32: eager and compiled sums then agree to rounding
    return model, tokenizer


def _prefilled(model, tokenizer, bits, n=300, chunk=64):
    ids = tokenizer.encode(CORPUS.read_text(encoding="utf-8")[: 8 * n])[:n]
    caches = make_kivi_cache(model, bits, 32, 64, packed=True)
    prompt = mx.array(ids)[None]
    for a in range(0, n - 1, chunk):
        model(prompt[:, a : min(a + chunk, n - 1)], cache=caches)
        mx.eval([c.state[:6] for c in caches])
    return caches, prompt[:, n - 1 :]


def _decode(model, caches, token, steps, compiled):
    dec = KIVIDecoder(model, caches) if compiled else None
    out, logits = [], []
    for _ in range(steps):
        lg = dec.step(token) if compiled else model(token, cache=caches)[:, -1, :]
        token = mx.argmax(lg, axis=-1).astype(mx.int32).reshape(1, 1)  # the prompt token is int32 too: one trace dtype
        mx.eval(token, lg)
        out.append(int(token.item()))
        logits.append(np.array(lg))
    return out, logits, dec


def _check(tiny, bits, steps=70):
    model, tokenizer = tiny
    (ce, te), (cc, tc) = _prefilled(model, tokenizer, bits), _prefilled(model, tokenizer, bits)
    eager, le, _ = _decode(model, ce, te, steps, False)
    comp, lc, dec = _decode(model, cc, tc, steps, True)
    assert comp == eager
    for a, b in zip(le, lc):
        assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a))
    # 70 steps from 299 tokens cross two flushes (every 32 tokens): those steps run eagerly
    assert dec.eager_steps == 2 and dec.compiled_steps == steps - 2
    assert all(a.offset == b.offset and a.quantized == b.quantized and a.nres == b.nres for a, b in zip(ce, cc))
    # The reference BLAS gives byte-identical caches; OpenBLAS (what make test preloads) rounds the
    # compiled graph's products differently from eager's, and a rounding-level difference can move
    # a value across a code boundary: residuals to rounding, codes all but a few the same.
    for a, b in zip(ce, cc):
        ka, kb = np.array(a.residual()[0]), np.array(b.residual()[0])
        assert np.max(np.abs(ka - kb)) <= 1e-5 * np.max(np.abs(ka))
        qa, qb = (np.array(c.kc[:, :, : c.quantized // 32]) for c in (a, b))
        assert qa.shape == qb.shape and np.mean(qa != qb) <= 1e-3, np.mean(qa != qb)
    return dec


@pytest.mark.parametrize("bits", [4, 2])
def test_compiled_step_same_tokens_as_eager(tiny, bits):
    dec = _check(tiny, bits)
    # on the CPU the tile loop is Python: one trace per quantized count (3 here), one more when the
    # code buffers grow (every 256 tokens)
    assert dec.traces <= 4 or kernels.backend() is not None


def test_compiled_step_refuses_other_caches(tiny):
    model, _ = tiny
    from mlx_lm.models.cache import make_prompt_cache

    with pytest.raises(ValueError, match="PackedKIVICache"):
        KIVIDecoder(model, make_prompt_cache(model))
    caches = make_kivi_cache(model, 4, 32, 64, packed=True)
    k = mx.zeros((1, 2, 40, 64), mx.float32)
    caches[0].update_and_fetch(k, k)
    with pytest.raises(ValueError, match="same position"):
        KIVIDecoder(model, caches)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("bits", [4, 2])
def test_compiled_step_with_the_kernel(tiny, bits):
    """With the decode kernel: the same tokens as eager, one trace while the code buffers keep their
    shape (the kernel reads the counts, not the trace's Python ints)."""
    dec = _check(tiny, bits)
    assert dec.traces <= 2


def test_generate_cli_compiled_packed_kivi(tiny_b4_reservoir, capsys):
    """``vqpipe generate --compiled whole --kv-bits 4`` (the packed cache): the same text as the eager
    packed cache through mlx-lm's generate, the KIVI summary line; split mode refuses it."""
    from vqpipe.apps import generate

    args = ["--model", str(tiny_b4_reservoir), "--prompt", "Hello sea " * 30, "-m", "40", "--kv-bits", "4", "--kv-residual", "32"]
    assert generate.main(args) == 0
    eager = capsys.readouterr().out.split("==========\n")[1].rstrip("\n")
    assert generate.main(args + ["--compiled", "whole"]) == 0
    out = capsys.readouterr().out
    assert out.split("==========\n")[1].rstrip("\n") == eager
    assert "(compiled step, whole, packed KIVI-4)" in out and "KV cache (KIVI)" in out
    with pytest.raises(SystemExit):
        generate.main(args + ["--compiled", "split"])
    assert "--compiled decodes greedily" in capsys.readouterr().err
