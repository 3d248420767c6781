"""mlx-lm models built without ``mlx_lm.utils``, for processes that need no tokenizer.

``mlx_lm.utils`` (its ``load_model``) imports transformers through the tokenizer code, ~0.9 of the
~1.35 CPU-s a fresh bench-load child took to load a tiny reservoir, and 40 MB of its RSS. For the
architectures vqpipe quantizes, from a plain config (no quantization, no custom model file, no
architecture remapping), ``load_model`` amounts to ``Model(ModelArgs.from_dict(config))`` in eval
mode plus the safetensors weights of the directory, sanitized; :func:`plain_model` does that and
nothing else, and gives up (None) on any other config, for the caller to use ``load_model``
(tests/test_plain_model.py compares the two). Importing ``mlx_lm.models.X`` runs the package's
``__init__``, which imports ``mlx_lm.utils``; :func:`models_only` lets a fresh process skip it.
"""

import glob
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx

# model_type values that mlx-lm's _get_classes maps to mlx_lm.models.<model_type> itself
PLAIN_TYPES = ("llama", "qwen2", "qwen3")
# config keys that make load_model do more than build and fill the model
_SPECIAL_KEYS = ("quantization", "quantization_config", "model_file", "quantize_activations", "text_config")


def models_only():
    """Make ``import mlx_lm.models.X`` skip ``mlx_lm/__init__.py`` in this process (and with it
    transformers): the package module is created without running it. ``from mlx_lm import load``
    then fails; ``import mlx_lm.utils`` still works. Call before anything imports mlx_lm."""
    if "mlx_lm" not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")
        sys.modules["mlx_lm"] = importlib.util.module_from_spec(spec)


def plain_model(model_dir, weights=False):
    """The model ``mlx_lm.utils.load_model(model_dir, lazy=True, strict=weights)`` returns, or None
    where that may differ (see the module docstring). ``weights``: load the directory's
    model*.safetensors (lazily, sanitized, every parameter required); else the directory must
    hold none (a skeleton: its random initial parameters are never evaluated)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    files = glob.glob(str(model_dir / "model*.safetensors"))
    if config.get("model_type") not in PLAIN_TYPES or any(k in config for k in _SPECIAL_KEYS) \
            or (model_dir / "hf_quant_config.json").exists() or (not files) == weights:
        return None
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    tensors = {}
    for f in files:
        tensors.update(mx.load(f))
    if hasattr(model, "sanitize"):
        tensors = model.sanitize(tensors)
    model.eval()
    model.load_weights(list(tensors.items()), strict=weights)
    return model
