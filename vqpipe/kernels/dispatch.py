"""Which GPU mat-vec runs a layer's decode call: the tensor-core kernel (revision 8, qmv_tc.py)
where ``qmv_tc.wanted`` says so on CUDA, else the CUDA-core/Metal kernel (revision 6, qmv.py)."""

from . import qmv, qmv_tc


def launch(dialect, x, packed, scales, codebook, bits, bias=None, group_size=None, rotation=None, splits=None,
           owner=None):
    """:func:`qmv.launch`'s call for a layer or fused group ``owner``: where the tensor-core kernel is
    wanted it runs on the owner's repacked copy of ``packed`` (made once, cached on it), the rotation
    as MLX ops."""
    if owner is not None and dialect == "cuda" and qmv_tc.wanted(x, bits, packed.shape[0]):
        xr = x if rotation is None else rotation.apply(x)
        return qmv_tc.launch(xr, qmv_tc.packed_for(owner, packed), packed.shape[0], scales, codebook, bias,
                             group_size, splits)
    return qmv.launch(dialect, x, packed, scales, codebook, bits, bias, group_size, rotation, splits)
