"""plain_model: the model mlx_lm.utils.load_model builds, without importing mlx_lm.utils."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from vqpipe.quant.plain_model import plain_model

ARCHS = [
    {"model_type": "llama", "tie_word_embeddings": True},
    {"model_type": "llama", "tie_word_embeddings": False},
    {"model_type": "qwen2", "tie_word_embeddings": True},
    {"model_type": "qwen3", "tie_word_embeddings": False, "head_dim": 16},
]
BASE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512}


def same_model(a, b):
    """Same classes module by module, same args, same parameter names, shapes and dtypes, same mode."""
    assert type(a) is type(b) and a.args == b.args and a.training is b.training is False
    assert [(n, type(m)) for n, m in a.named_modules()] == [(n, type(m)) for n, m in b.named_modules()]
    pa, pb = tree_flatten(a.parameters()), tree_flatten(b.parameters())
    assert [(k, v.shape, v.dtype) for k, v in pa] == [(k, v.shape, v.dtype) for k, v in pb]
    return dict(pa), dict(pb)


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"{a['model_type']}-tied{a['tie_word_embeddings']}")
def test_skeleton_and_weights_are_load_models(arch, tmp_path):
    from mlx_lm.utils import load_model

    config = {**BASE, **arch}
    (tmp_path / "config.json").write_text(json.dumps(config))
    same_model(plain_model(tmp_path), load_model(tmp_path, lazy=True, strict=False)[0])
    assert plain_model(tmp_path, weights=True) is None  # no weights to load: load_model's error, not ours

    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    donor = load_model(tmp_path, lazy=True, strict=False)[0]
    rng = np.random.default_rng(0)
    weights = {k: mx.array(rng.standard_normal(v.shape).astype(np.float32)).astype(mx.bfloat16)
               for k, v in tree_flatten(donor.parameters())}
    if config["model_type"] == "llama":
        weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.zeros((8,))  # llama's sanitize drops it
    mx.save_safetensors(str(source / "model.safetensors"), weights)
    got, want = same_model(plain_model(source, weights=True), load_model(source, lazy=True)[0])
    assert all(np.array_equal(np.asarray(got[k].astype(mx.float32)), np.asarray(want[k].astype(mx.float32)))
               for k in want)
    assert plain_model(source) is None  # weights present: a skeleton would have ignored them


@pytest.mark.parametrize("extra", [{"quantization": {"group_size": 64, "bits": 4}}, {"model_type": "mistral"},
                                   {"model_type": "gemma"}, {"model_file": "custom.py"}, {"text_config": {}}])
def test_anything_else_is_left_to_load_model(extra, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama", **extra}))
    assert plain_model(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
    (tmp_path / "hf_quant_config.json").write_text("{}")
    assert plain_model(tmp_path) is None


def test_models_only_imports_no_transformers(tmp_path):
    """A fresh process builds a model and runs it with mlx_lm.models only."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
    code = ("import sys; from vqpipe.quant.plain_model import models_only, plain_model; models_only(); "
            "import mlx.core as mx; m = plain_model(sys.argv[1]); mx.eval(m(mx.array([[1, 2, 3]]))); "
            "print('transformers' in sys.modules, 'mlx_lm.utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
