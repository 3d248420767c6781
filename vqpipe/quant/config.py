"""The settings of a quantization: what ``quantize_model`` does, apart from the data it is given.

Its defaults are the quantize CLI's and the pipeline's (tests/test_recipe.py checks they agree):
4 bits, the automatic rotation, the embedding quantized, tensors that stay unquantized in their
source dtype, calibrated on the shipped text (64 windows x 512 tokens) with per-layer widths to
bits + 0.5 bits per weight, on every core this process may run on.
"""

from dataclasses import dataclass, field

import mlx.core as mx

from ..codec import allocate
from ..codec.codebook import check_bits
from ..codec.rotation import KINDS
from ..layers.qlinear import CODES
from ..parallel import check_threads, default_threads
from . import recipe, tune
from .calibrate import CALIBRATION_TEXTS

DTYPES = ("float32", "bfloat16", "float16")
CALIB_TEXTS = ("auto",) + CALIBRATION_TEXTS


@dataclass(frozen=True)
class QuantizeConfig:
    """How to quantize a model (vqpipe/quant/quantize.py ``quantize_model``).

    - ``bits``: the model's width; ``rotation``: a kind of vqpipe/codec/rotation.py, seeded by ``seed``.
    - ``embeddings``: quantize the embedding table (and so a tied head); ``lm_head``: an untied head.
    - ``dtype``: of the tensors that stay unquantized, a name or an mx dtype, kept by name (None:
      each as the source stores it).
    - ``group_size``: a scale per that many rotated entries of a row (None: one per row);
      ``damp``: GPTQ damping (None: vqpipe/codec/gptq.py's).
    - ``fuse``: q/k/v and gate/up computed as one, as the loaders do.
    - ``sequential``: each block's moments from the already quantized blocks (no allocation then).
    - ``layer_bits``: rules [{match, add|bits}] (vqpipe/codec/allocate.py) that replace the allocation.
    - ``residual``: fold one rotation of the residual stream into the model first.
    - ``budget``: bits per weight for the per-layer widths ('auto': bits + 0.5, 'none': every
      layer at ``bits``, or a number).
    - ``threads``: for the numpy work; the result does not depend on it.
    - ``calib_text``: the calibration text a tokenizer makes ('auto' and 'text': the shipped text,
      'self': the model's own, 'none': data-free), ``calib_windows`` x ``calib_length`` tokens at
      offsets from ``calib_seed``.
    - ``tune_steps``: Adam steps of end-to-end tuning of the row scales against the
      source after quantization (vqpipe/quant/tune.py), one calibration window each; 0: none;
      "auto": 64 at 2 bits, 32 at 3, none above (``tune.steps_for``).
      Only with calibration tokens (data-free quantization has none). ``tune_lr``: its rate at the
      first step (a cosine decay to a tenth by the last); ``tune_length``: tokens per step (the
      calibration windows cut into pieces of this length).
    - ``codes``: "trellis" (bitshift-trellis codes, vqpipe/codec/ldlq.py; the default: lower error
      than the scalar codebook at every width measured, docs/quantize.md) for every layer that can
      take them (vqpipe/layers/qlinear.py ``trellis_fits``: widths 2-5, rows a multiple of 32,
      inputs of 8, per-row scales, so with ``group_size`` set every layer is scalar); the others,
      and every layer with "scalar", take the Lloyd-Max codebook.
    """

    bits: int = 4
    rotation: str = "auto"
    seed: int = 0
    embeddings: bool = True
    lm_head: bool = True
    dtype: str | None = None
    group_size: int | None = None
    damp: float | None = None
    fuse: bool = True
    sequential: bool = False
    layer_bits: list | None = None
    residual: bool = False
    budget: str | float = "auto"
    threads: int = field(default_factory=default_threads)
    calib_text: str = "auto"
    calib_windows: int = 64
    calib_length: int = 512
    calib_seed: int = 0
    codes: str = "trellis"
    tune_steps: int | str = "auto"
    tune_lr: float = 1e-3
    tune_length: int = 256

    def __post_init__(self):
        check_bits(self.bits)
        if self.rotation not in KINDS:
            raise ValueError(f"unknown rotation {self.rotation!r}; choose one of {', '.join(KINDS)}")
        if isinstance(self.dtype, mx.Dtype):  # kept by name: comparable, and printed as the CLI's
            object.__setattr__(self, "dtype", str(self.dtype).rsplit(".", 1)[-1])
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of None (the source's), {', '.join(DTYPES)}")
        if self.group_size is not None and not (_integer(self.group_size) and self.group_size >= 1):
            raise ValueError(f"group_size must be a positive integer or None, got {self.group_size!r}")
        if self.damp is not None and not (isinstance(self.damp, (int, float)) and 0 < self.damp < 1):
            raise ValueError(f"damp must be in (0, 1), got {self.damp!r}")
        if self.layer_bits is not None:
            allocate.check_rules(self.layer_bits)
        recipe.check_budget(self.budget, self.bits)
        check_threads(self.threads)
        if self.calib_text not in CALIB_TEXTS:
            raise ValueError(f"unknown calib_text {self.calib_text!r}; choose one of {', '.join(CALIB_TEXTS)}")
        if not (_integer(self.calib_windows) and self.calib_windows >= 1):
            raise ValueError(f"calib_windows must be an integer of at least 1, got {self.calib_windows!r}")
        if not (_integer(self.calib_length) and self.calib_length >= 2):
            raise ValueError(f"calib_length must be an integer of at least 2, got {self.calib_length!r}")
        tune.steps_for(self.tune_steps, self.bits)  # "auto" or an integer >= 0
        if not (isinstance(self.tune_lr, (int, float)) and not isinstance(self.tune_lr, bool) and 0 < self.tune_lr < 1):
            raise ValueError(f"tune_lr must be in (0, 1), got {self.tune_lr!r}")
        if not (_integer(self.tune_length) and self.tune_length >= 2):
            raise ValueError(f"tune_length must be an integer of at least 2, got {self.tune_length!r}")
        if self.codes not in CODES:
            raise ValueError(f"unknown codes {self.codes!r}; choose one of {', '.join(CODES)}")


def _integer(value):
    return isinstance(value, int) and not isinstance(value, bool)
