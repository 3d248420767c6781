"""CPU checks of the qmv GPU-time harness (experiments/qmv_gpu_time.py, experiments/cuda_time.py).

The harness launches the kernel through the CUDA driver with MLX's parameter list rebuilt by hand;
nothing here needs a GPU: the wrapper it generates must have the parameters, in the order, that
its argument list fills, for every template the timing uses, and its float64 check must read the
packed words and bfloat16 values as vqpipe writes them.
"""

import re

import mlx.core as mx
import numpy as np
import pytest

from vqpipe.kernels import qmv
from experiments import cuda_time as ct
from experiments import qmv_gpu_time as gt
from vqpipe.codec.bitpack import pack, words_per_row

INPUTS = [("x", "bfloat16", 3), ("packed", "uint32", 2), ("scales", "float32", 1), ("codebook", "float32", 1),
          ("bias", "bfloat16", 2), ("rot_s", "float32", 2), ("rot_l", "float32", 2), ("seg", "int32", 1)]


def _params(src):
    head = re.search(r"void \w+\(\n(.*?)\) \{", src, re.S).group(1)
    return [p.strip().split()[-1] for p in head.split(",\n")]


@pytest.mark.parametrize("bits, m, stages", [(4, 1, None), (2, 1, 0), (3, 4, None), (4, 8, 3), (8, 2, 2)])
def test_wrapper_parameters_match_the_argument_list(bits, m, stages):
    n_in, n_out = 4096, 6144
    spec = qmv.launch_spec((1, m, n_in), (n_out, words_per_row(n_in, bits)), (n_out,), 1 << bits, None, bits,
                           mx.bfloat16, stages=stages)
    name, header, body = qmv.render("cuda", 1)
    src = ct.kernel_source(name, header, body, INPUTS, [("out0", "bfloat16")],
                           [(k, gt._dtype_name(v)) for k, v in spec["template"]])
    # MLX's rule (custom_kernel.cpp): NAME_shape / NAME_ndim parameters for the names the body uses
    assert _params(src) == ["x", "x_shape", "x_ndim", "packed", "packed_shape", "scales", "scales_shape", "codebook",
                            "bias", "bias_ndim", "rot_s", "rot_l", "rot_l_shape", "seg", "out0"]
    bufs = dict.fromkeys(("x", "packed", "scales", "codebook", "bias", "rot_s", "rot_l", "seg", "out"), 0)
    wpr = words_per_row(n_in, bits)
    args = gt.kernel_args(src, bufs, (1, m, n_in), (n_out, wpr), (n_out,))
    assert len(args) == 15
    shapes = [a for a in args if isinstance(a, ct.ctypes.Array)]
    assert [list(a)[:3] for a in shapes] == [[1, m, n_in], [n_out, wpr, 0], [n_out, 0, 0], [1, 1, 0]]
    assert f"constexpr int RING = {qmv.ring_for(spec['template'][4][1], stages)};" in src
    assert f"constexpr int LUT = {dict(spec['template'])['LUT']};" in src


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_rows_reads_vqpipe_packing(bits):
    q = np.random.default_rng(bits).integers(0, 1 << bits, (7, 100))
    words = np.array(pack(mx.array(q.astype(np.uint32)), bits)).view(np.uint32)
    assert np.array_equal(gt.unpack_rows(words, bits, 100), q)


def test_bf16_conversion_rounds_as_mlx():
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 3
    want = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    assert np.array_equal(gt.bf16_value(gt.bf16_bits(x)), want)


def test_ring_choice():
    assert [qmv.ring_for(mt) for mt in (1, 2, 4, 8)] == [0, 0, 0, 4]
    assert qmv.ring_for(8, dialect="metal") == 2 and qmv.ring_for(1, 3) == 3
    with pytest.raises(ValueError, match="ring stages"):
        qmv.ring_for(1, 1)
    with pytest.raises(ValueError, match="ring stages"), qmv.ring_stages(5):
        pass
    with qmv.ring_stages(3):
        assert qmv.STAGES == 3
    assert qmv.STAGES is None


def test_ablations_change_the_kernel_they_name():
    from vqpipe.kernels import qmv_tc

    name, header, body = qmv.render("cuda", 1)
    for abl in gt.ABLATIONS:
        src = qmv_tc.render(1)[1:] if abl.startswith("tc") else (header, body)  # revision 8's own ablations
        assert gt.ablate(*src, [abl]) != src
    h2, b2 = gt.ablate(header, body, ["nolut", "noload"])
    assert "cb_s[qmv_index" not in b2 and "*reinterpret_cast<const uint4*>(p + off)" not in h2
    assert "reinterpret_cast<const unsigned char*>(t) + qmv_pair_off" not in h2
    with pytest.raises(ValueError, match="unknown ablation"):
        gt.ablate(header, body, ["nofma"])
    with pytest.raises(ValueError, match="matches nothing"):
        gt.ablate("", "", ["noload"])


def test_tc_variant_names_parse():
    v = gt.Variant("qmv_tc:264:0:0:2", None, {})
    assert (v.tc, v.blocks, v.target, v.minb, v.pf, v.ablations) == (True, 264, None, 0, 2, ())
    v = gt.Variant("qmv_tc:0:0:3:0:tcnolut+tcnoload", None, {})
    assert (v.blocks, v.minb, v.pf, v.ablations) == (None, 3, None, ("tcnolut", "tcnoload"))
    assert not gt.Variant("qmv_tc", None, {}).ablations


def test_variant_names_parse():
    v = gt.Variant("qmv:0:528:1:nolut+noload", None, {})
    assert (v.stages, v.blocks, v.lut, v.ablations) == (0, 528, 1, ("nolut", "noload"))
    v = gt.Variant("qmv", None, {})
    assert (v.stages, v.blocks, v.lut, v.ablations) == (None, None, None, ())
    # the variant's LUT reaches the template, and the 4-bit pair table takes 256-thread threadgroups
    for lut, warps in ((0, 4), (1, 8)):
        spec = gt.Variant(f"qmv:auto:0:{lut}", None, {}).spec((1, 1, 4096), (28672, 512), (28672,), 4, mx)
        assert dict(spec["template"])["LUT"] == lut
        assert spec["threadgroup"][1] * spec["threadgroup"][2] == warps
    v = gt.Variant("qmv:0:0:1::2", None, {})
    assert (v.lut, v.rows, v.ablations) == (1, 2, ())
    assert dict(v.spec((1, 1, 4096), (28672, 512), (28672,), 4, mx)["template"])["NR"] == 2


def test_pair_tables_only_where_asked_and_where_they_apply():
    assert [qmv.lut_for(b, 0, 0) for b in (2, 3, 4, 8)] == [0, 0, 0, 0]  # the default: revision 6's lookups
    assert [qmv.lut_for(b, 0, 0, 1) for b in (2, 3, 4, 8)] == [1, 1, 1, 0]
    assert qmv.lut_for(4, 4, 0, 1) == 0 and qmv.lut_for(4, 0, 1024, 1) == 0  # the ring, the prologue
    assert qmv.lut_for(4, 0, 0, 1, "metal") == 0 and qmv.lut_for(3, 0, 0, 1, "metal") == 1  # 32 KiB
    with pytest.raises(ValueError, match="lut must be"):
        qmv.lut_for(4, 0, 0, 2)
    with pytest.raises(ValueError, match="rows per warp"):
        qmv.rows_for(4, 0, 3)
    spec = lambda m, **kw: dict(qmv.launch_spec((1, m, 4096), (28672, 512), (28672,), 16, None, 4, mx.bfloat16,
                                                **kw)["template"])
    assert spec(1, lut=1)["LUT"] == 1 and spec(8, lut=1)["LUT"] == 0 and spec(8, lut=1, stages=0)["LUT"] == 1
    with qmv.lut_tables(1):
        assert qmv.LUT == 1
    assert qmv.LUT is None
