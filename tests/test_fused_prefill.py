"""The dense (prefill) path's weight rebuild through field tables (vqpipe/kernels/dequant.py): the same
values as codebook[unpack(packed)], bit for bit, with no weight-sized uint32 temporaries (CPU)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from vqpipe.kernels import dequant, ext
from vqpipe.codec.bitpack import pack, unpack
from vqpipe.layers.qlinear import QuantizedLinear
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model
from vqpipe.codec.rotation import make_rotation


def _packed(bits, rows, n, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, 1 << bits, (rows, n)).astype(np.uint8)
    codebook = mx.array(rng.standard_normal(1 << bits).astype(np.float32))
    return mx.array(pack(idx, bits)), codebook, idx


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n", [256, 100, 4864])  # 100: a padded row (rows hold 128 values)
def test_same_values_as_unpack(bits, n):
    packed, codebook, idx = _packed(bits, 19, n, seed=bits * n)
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        want = codebook.astype(dtype)[unpack(packed, bits, n)]
        got = dequant.codes_to_values(packed, codebook, bits, n, dtype)
        assert got.shape == (19, n) and got.dtype == dtype
        assert np.array(got.astype(mx.float32)).tobytes() == np.array(want.astype(mx.float32)).tobytes()
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(codebook.astype(mx.float16))[idx].astype(np.float32))


def test_table_is_cached_per_codebook_and_dropped_with_it():
    packed, codebook, _ = _packed(4, 4, 64)
    t = dequant.table(codebook, 4, mx.float32)
    assert dequant.table(codebook, 4, mx.float32) is t and t.shape == (256, 2)
    assert dequant.table(codebook, 4, mx.bfloat16) is not t
    key = (id(codebook), 4, mx.float32)
    assert key in dequant._tables
    del codebook, t
    assert key not in dequant._tables


@pytest.mark.parametrize("bits", [4, 3])
def test_no_weight_sized_uint32_temporaries(bits):
    """Peak memory of one rebuild over what was allocated before it: the weight (float32) and
    small field arrays, where the old rebuild held two (4-bit) or more (3-bit) uint32 copies."""
    rows, n = 1024, 2048
    packed, codebook, _ = _packed(bits, rows, n)
    out = rows * n * 4
    peaks = {}
    for flag in (False, True):
        with dequant.using_tables(flag):
            mx.eval(dequant.codes_to_values(packed, codebook, bits, n, mx.float32))  # table built
            mx.synchronize()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            w = dequant.codes_to_values(packed, codebook, bits, n, mx.float32)
            mx.eval(w)
            peaks[flag] = mx.get_peak_memory() - base
            del w
    assert peaks[False] >= 1.9 * out  # what the old path costs: the measurement can tell them apart
    assert peaks[True] <= (1.05 if bits == 4 else 1.55) * out, peaks


def test_group_scales_and_bias_same_as_before():
    rng = np.random.default_rng(1)
    n_in, n_out, gs = 256, 40, 64
    packed, codebook, _ = _packed(3, n_out, n_in, seed=5)
    scales = mx.array(rng.uniform(0.5, 1.5, (n_out, n_in // gs)).astype(np.float16))
    bias = mx.array(rng.standard_normal(n_out).astype(np.float32))
    layer = QuantizedLinear(n_in, n_out, 3, make_rotation("auto", n_in, 2), packed, scales, codebook, bias, gs)
    x = mx.random.normal((2, 20, n_in), key=mx.random.key(3))
    with ext.using(False):  # the dense path (M = 40 would take vqpipe/kernels/ext.py's kernel on the CPU)
        got = layer(x)
    with dequant.using_tables(False):  # the old rebuild, and the old repeat of the scales
        xr = layer.rotation.apply(x)
        w = codebook[unpack(packed, 3, n_in)] * mx.repeat(scales.astype(mx.float32), gs, axis=-1)
        want = xr @ w.T + bias
    assert np.array(got).tobytes() == np.array(want).tobytes()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_prefill_logits_and_tokens_unchanged(tiny_llama_source, tiny_source, bits):
    for source in (tiny_source, tiny_llama_source):
        model, _ = load(str(source))
        quantize_model(model, QuantizeConfig(bits, dtype=mx.float32, threads=1, calib_text="none"))
        x = mx.random.randint(0, 8000, (1, 40), key=mx.random.key(bits))
        got = np.array(model(x))
        with dequant.using_tables(False):
            want = np.array(model(x))
        assert got.tobytes() == want.tobytes()  # the same weights: the same bytes, not just close
        assert len(set(np.argmax(got[0], axis=-1).tolist())) > 3


def test_decode_shapes_ab_arms_on_cpu(tmp_path):
    """experiments/decode_shapes's A/B arms: the old weight rebuild (+u) and the unfolded model (-nofold)
    give the same ids as vqpipe-b4; the unfolded step has 3 primitives more per layer."""
    import json

    from experiments import decode_shapes

    out = tmp_path / "ab.json"
    with mx.stream(mx.cpu):
        assert decode_shapes.main(["--preset", "tiny-llama", "--out", str(out), "--bits", "4", "--unpack-bits", "4",
                                   "--unfolded-bits", "4", "--prompt-lengths", "16", "--gen-tokens", "3",
                                   "--repeats", "2", "--copy-mib", "16"]) == 0
    doc = json.loads(out.read_text())
    assert {r["arm"] for r in doc["records"]} == {"bf16", "affine4", "vqpipe-b4", "vqpipe-b4+u", "vqpipe-b4-nofold"}
    prof = doc["step_profile"]
    layers = doc["config"]["num_hidden_layers"]
    assert prof["vqpipe-b4-nofold"]["ops"] - prof["vqpipe-b4"]["ops"] == 3 * layers
    exact = [t for t in doc["texts"] if t.get("what", "").startswith("exact")]
    assert {t["b"] for t in exact} == {"vqpipe-b4+u", "vqpipe-b4-nofold"}
    assert all(t["identical_ids"] == t["pairs"] == 2 for t in exact)
    pairs = {(c["baseline_arm"], c["other_arm"]) for c in doc["comparisons"]}
    assert {("vqpipe-b4", "vqpipe-b4+u"), ("vqpipe-b4", "vqpipe-b4-nofold")} <= pairs


@pytest.mark.parametrize("bits", [3, 4])
def test_padded_rows_layer_same_bytes(bits):
    """in_features 50 (rows padded to 64 values): the sliced weight is made contiguous, as before."""
    packed, codebook, _ = _packed(bits, 24, 50, seed=bits)
    scales = mx.array(np.random.default_rng(2).uniform(0.5, 1.5, 24).astype(np.float32))
    layer = QuantizedLinear(50, 24, bits, make_rotation("auto", 50, 1), packed, scales, codebook)
    x = mx.random.normal((1, 30, 50), key=mx.random.key(4))
    got = np.array(layer(x))
    with dequant.using_tables(False):
        want = np.array(layer(x))
    assert got.tobytes() == want.tobytes()
