"""quantize_model on several threads (vqpipe/parallel.py): the same bytes and records as on one."""

import mlx.core as mx
import numpy as np
import pytest

from vqpipe import blas, parallel
from vqpipe.layers import qlinear
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model, split_state

from test_reservoir import make_model

TIED = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": True}
CALIB = mx.array(np.random.default_rng(5).integers(0, 256, (4, 32)), dtype=mx.int32)


def _state(model, records):
    metas, arrays, params = split_state(model)
    arrays = {k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v).tobytes() for k, v in arrays.items()}
    records = [{k: v for k, v in r.items() if k != "seconds"} for r in records]
    return metas, arrays, records


def _quantize(threads, sequential=False, **data):
    model, _ = make_model(TIED)
    config = QuantizeConfig(3, seed=1, group_size=16, sequential=sequential, threads=threads, dtype="float32",
                            calib_text="none")
    records = quantize_model(model, config, **data)
    return _state(model, records)


@pytest.mark.parametrize("kw", [{"calibration": CALIB}, {"calibration": CALIB, "sequential": True},
                                {}], ids=["full-precision", "sequential", "data-free"])
def test_threads_give_the_same_bytes(monkeypatch, kw):
    # Uneven row jobs of a few rows (the real ones are >= 1024 rows: these layers would be one job),
    # the same jobs on one thread and on three.
    monkeypatch.setattr(qlinear, "_job_rows", lambda rows: max(2, rows // 5))
    one = _quantize(1, **kw)
    three = _quantize(3, **kw)
    assert one[0] == three[0] and one[2] == three[2]
    assert one[1].keys() == three[1].keys() and all(one[1][k] == three[1][k] for k in one[1])


def test_stored_moments_on_threads(monkeypatch):
    from vqpipe.quant.calibrate import full_precision_moments

    source, _ = make_model(TIED)
    names, sums = full_precision_moments(source, CALIB)
    moments = {n: (k, sums[k]) for n, k in names.items()}
    monkeypatch.setattr(qlinear, "_job_rows", lambda rows: max(2, rows // 3))
    one = _quantize(1, moments=moments)
    two = _quantize(2, moments=moments)
    assert one == two
    assert all(r.get("hessian") for r in one[2])


def test_job_rows():
    from vqpipe.codec.gptq import _chunks

    def jobs(rows):
        return [b - a for a, b in _chunks(rows, qlinear._job_rows(rows))]

    assert jobs(896) == [896] and jobs(128) == [128] and jobs(2048) == [1024, 1024]
    assert jobs(4864) == [2432, 2432]
    assert jobs(151936) == [8192] * 18 + [151936 - 18 * 8192]


def test_pool_inline_and_threaded():
    calls = []
    with parallel.Pool(1) as pool:
        assert pool.map(lambda x: calls.append(x) or x * x, [3, 1, 2]) == [9, 1, 4]
    assert calls == [3, 1, 2]  # inline: in submission order
    with parallel.Pool(2) as pool:
        assert pool.map(lambda x: x + 1, range(10)) == list(range(1, 11))
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="threads"):
            parallel.Pool(bad)
    assert parallel.default_threads() >= 1


def test_pool_threads_yield_to_the_main_thread():
    import os
    import threading

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with parallel.Pool(2) as pool:
        nice = pool.map(lambda _: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), range(4))
    assert all(n == min(19, main + parallel.POOL_NICE) for n in nice)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


def test_pool_sets_blas_to_one_thread_and_back():
    before = [getter() for _, getter in _getters()]
    with parallel.Pool(2):
        assert all(getter() == 1 for _, getter in _getters())
    assert [getter() for _, getter in _getters()] == before


def _getters():
    """(name, get_num_threads) of the OpenBLAS builds Pool sets (none found: nothing to check)."""
    found = [(setter, old) for setter, old in blas.set_threads(1)]
    for setter, old in found:
        setter(old)
    import ctypes

    from numpy._core import _multiarray_umath as umath

    out = []
    for lib in (ctypes.CDLL(None), ctypes.CDLL(umath.__file__)):
        for _, get_name in blas.OPENBLAS_THREADS:
            fn = getattr(lib, get_name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                out.append((get_name, fn))
    return out
