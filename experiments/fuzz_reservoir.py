"""Fuzz target for the reservoir reader (``experiments.fuzz``; campaign: scripts/fuzz.py reservoir).

Two tiny base reservoirs (every layer class, rotation kind and blob kind between them, one with
dense QR rotations stored as seeds) are mutated, one seeded mutation per case, and loaded with
``load_reservoir`` (embedded config, so the config is untrusted input too). Outcomes:

- ``rejected``: ReservoirError.
- ``harmless``: it loaded and its logits are byte-identical to the base model's.
- ``as-described``: only for *forged* files (header or blob rewritten with valid checksums, as a
  buggy or hostile writer would): it loaded a different model, and every tensor, layer field and
  config value of that model is what the file says (checked against an independent numpy decoding
  of the bytes). The reader cannot tell such a file from a genuine one; it must only be faithful.
- failures: ``other`` (any other exception), ``wrong-model`` (loaded something the bytes do not
  say, or a damaged file loaded different logits), ``unusable`` (loaded, then the forward pass
  raised); the runner adds ``crash`` and ``hang``.

Mutations ("damage" unless marked forged): bit flips (anywhere, or in the prefix, header or
blobs), byte overwrites, truncations (at random or at every structural boundary), extensions,
prefix fields set to edge values (prefix checksum fixed or not), splices of two files, JSON text
edits (header checksum fixed: forged), structure-aware header edits (forged: a field of the
blob table, a tensor's blob/dtype/shape, a layer's meta, rotation, config; set to edge values,
perturbed, deleted, added, swapped, retyped, nested deeply), and forged blobs (a bit flipped and
its checksum recomputed). Some cases stack two mutations.
"""

import copy
import dataclasses
import json
import random
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash

from vqpipe.store import reservoir as R

PREFIX = struct.Struct("<8sIIQQQQQ")
TOKENS = [[1, 5, 9, 2, 33, 31, 4, 60]]
ARCH = {"num_hidden_layers": 1, "vocab_size": 64, "rms_norm_eps": 1e-6, "hidden_size": 32,
        "intermediate_size": 38, "num_attention_heads": 4, "num_key_value_heads": 2}
# name -> (architecture overrides, bits, rotation, quantize embeddings, persist_rotation)
BASES = {
    # hadamard (32) + kron (38 = 19 x 2), a quantized tied embedding, biases (qwen2 q/k/v).
    "auto": ({"model_type": "qwen2", "tie_word_embeddings": True}, 4, "auto", True, True),
    # dense QR stored as seeds (regenerated at load), an untied quantized lm_head, 3 bits.
    "qr-off": ({"model_type": "llama", "tie_word_embeddings": False}, 3, "qr", False, False),
}
INTS = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 19, 31, 32, 33, 38, 63, 64, 65, 255, 256, 4095, 4096, 16383,
        16384, 16385, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
        2**64 - 1, 2**64, 10**30, -1, -2, -(2**31), -(2**63)]
STRINGS = ["", "x", "float32", "float16", "bfloat16", "uint32", "int64", "uint8", "QuantizedLinear",
           "QuantizedEmbedding", "hadamard", "kron", "qr", "none", "packed", "scales", "codebook",
           "rotation", "bias", "param", "xxh3_64", "vqpipe-reservoir", "qwen2", "llama", "../../x",
           "mlx_lm.models.base", "0" * 16, "model.embed_tokens", "lm_head", "\u0000", "\ud800"]
# Header paths a structure-aware edit favours (prefixes of the path as a tuple of keys).
HOT = ("blobs", "layers", "params", "config", "format_version", "persist_rotation", "checksum")


@dataclasses.dataclass
class Deep:
    """``depth`` nested lists around ``value``, spliced into the JSON text (json.dumps would recurse)."""

    depth: int
    value: object


def _dumps(header):
    deep = []

    def default(o):
        if isinstance(o, Deep):
            deep.append(o)
            return f"@deep{len(deep) - 1}@"
        raise TypeError(type(o).__name__)

    text = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=True, default=default)
    for i, d in enumerate(deep):
        text = text.replace(f'"@deep{i}@"', "[" * d.depth + json.dumps(d.value, default=default) + "]" * d.depth)
    return text.encode("utf-8", "surrogatepass")


@dataclasses.dataclass
class Base:
    name: str
    data: bytes
    header: dict  # the parsed JSON header, as written
    data_offset: int
    logits: bytes


# --- the base files --------------------------------------------------------------------------


def _build(name, directory):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from vqpipe.quant.config import QuantizeConfig
    from vqpipe.quant.quantize import quantize_model

    arch, bits, rotation, embeddings, persist = BASES[name]
    config = {**ARCH, **arch}
    model_class, args_class = _get_classes(config)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(config))
    norms = [(k, mx.random.uniform(0.5, 1.5, v.shape)) for k, v in tree_flatten(model.parameters()) if "norm" in k]
    model.load_weights(norms, strict=False)
    mx.eval(model.parameters())
    quantize_model(model, QuantizeConfig(bits, rotation, 3, embeddings, dtype="float32", threads=1, calib_text="none"))
    path = Path(directory) / f"base-{name}.vqres"
    R.save_reservoir(model, path, persist_rotation=persist, config=config)
    return model, path


def logits_bytes(model):
    out = model(mx.array(TOKENS, dtype=mx.int32)).astype(mx.float32)
    mx.eval(out)
    return np.array(out).tobytes()


def prepare(workdir):
    """Build the base reservoirs in ``workdir`` (no config.json next to them: the embedded config
    is used) and the scratch path mutated files are written to."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bases = []
    for name in BASES:
        model, path = _build(name, workdir)
        want = logits_bytes(model)
        if logits_bytes(R.load_reservoir(path)) != want:
            raise RuntimeError(f"base {name}: the unmutated file does not load bit-exactly")
        data = path.read_bytes()
        _, _, _, hlen, _, data_offset, _, _ = PREFIX.unpack_from(data)
        bases.append(Base(name, data, json.loads(data[64:64 + hlen]), data_offset, want))
    scratch = workdir / "case"
    scratch.mkdir(exist_ok=True)
    return {"bases": bases, "path": scratch / R.FILE_NAME}


# --- assembling files -----------------------------------------------------------------------


def _prefix_version(header):
    """The prefix's format version: the header's own (the writer puts the same number in both;
    a file without group scales is version 1), else the newest."""
    try:
        h = header if isinstance(header, dict) else json.loads(header)
        version = h.get("format_version")
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
        version = None
    return version if version in R.READS else R.VERSION


def assemble(header, blobs, data_offset=None, fix_header_hash=True, fix_prefix=True):
    """A reservoir file from a header (dict, or JSON bytes) and blob-area bytes, with its
    prefix fields and checksums made consistent (unless told not to)."""
    text = header if isinstance(header, bytes) else _dumps(header)
    need = -(-(64 + len(text)) // R.ALIGN) * R.ALIGN
    data_offset = max(need, data_offset or 0)
    size = data_offset + len(blobs)
    hh = xxhash.xxh3_64_intdigest(text) if fix_header_hash else 0
    head = PREFIX.pack(R.MAGIC, _prefix_version(header), 0, len(text), hh, data_offset, size, 0)[:48]
    ph = xxhash.xxh3_64_intdigest(head) if fix_prefix else 0
    return bytearray(head + struct.pack("<Q", ph) + bytes(8) + text + bytes(data_offset - 64 - len(text)) + blobs)


def reprefix(data, fix=True, **fields):
    names = ("magic", "version", "flags", "header_len", "header_hash", "data_offset", "file_size")
    values = dict(zip(names, PREFIX.unpack_from(data)))
    values.update(fields)
    head = struct.pack("<8sIIQQQQ", *[values[n] for n in names])
    data[:48] = head
    if fix:
        data[48:56] = struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return data


# --- mutations: damage (no checksum is recomputed for the damaged part) ----------------------


def _region(rng, base, data):
    hend = 64 + len(json.dumps(base.header, sort_keys=True, separators=(",", ":")))
    return rng.choice([(0, 64), (64, hend), (base.data_offset, len(data)), (0, len(data))])


def m_bitflip(rng, base, data):
    lo, hi = _region(rng, base, data)
    hi = min(hi, len(data))
    if hi <= lo:
        return data, "bitflip (empty region)"
    where = [rng.randrange(lo, hi) for _ in range(rng.choice([1, 1, 1, 2, 3, 8]))]
    for w in where:
        data[w] ^= 1 << rng.randrange(8)
    return data, f"bitflip at {where}"


def m_bytes(rng, base, data):
    lo, hi = _region(rng, base, data)
    hi = min(hi, len(data))
    if hi <= lo:
        return data, "bytes (empty region)"
    at, n = rng.randrange(lo, hi), rng.choice([1, 2, 4, 8, 64, 4096])
    fill = rng.choice([b"\x00", b"\xff", None])
    chunk = bytes(rng.randrange(256) for _ in range(n)) if fill is None else fill * n
    data[at:at + n] = chunk[:len(data[at:at + n])]
    return data, f"{n} bytes at {at} set to {fill!r}"


def _boundaries(base, data):
    hl = PREFIX.unpack_from(data)[3]
    b = [0, 1, 8, 47, 48, 56, 63, 64, 65, 64 + hl - 1, 64 + hl, base.data_offset - 1, base.data_offset,
         len(data) - 1]
    for blob in base.header["blobs"]:
        s = base.data_offset + blob["offset"]
        b += [s, s + 1, s + blob["nbytes"] - 1]
    return [x for x in b if 0 <= x < len(data)]


def m_truncate(rng, base, data):
    at = rng.choice(_boundaries(base, data)) if rng.random() < 0.5 else rng.randrange(len(data))
    fix = rng.random() < 0.5  # also make the prefix claim the new size (a consistent-looking cut)
    del data[at:]
    if fix and len(data) >= 64:
        reprefix(data, file_size=len(data))
    return data, f"truncated to {at} (prefix size fixed: {fix})"


def m_extend(rng, base, data):
    n = rng.choice([1, 7, 64, 4096, 16384, 100000])
    data += bytes(n) if rng.random() < 0.5 else bytes(rng.randrange(256) for _ in range(min(n, 4096))) * (n // min(n, 4096))
    fix = rng.random() < 0.5
    if fix:
        reprefix(data, file_size=len(data))
    return data, f"extended by {n} (prefix size fixed: {fix})"


def m_prefix_field(rng, base, data):
    field = rng.choice(["version", "flags", "header_len", "header_hash", "data_offset", "file_size", "magic"])
    if field == "magic":
        value = rng.choice([bytes(8), b"\x89VQRES\n\n", b"GGUF\x03\x00\x00\x00", R.MAGIC[::-1]])
    elif field in ("version", "flags"):
        value = rng.choice([0, 2, 3, 2**31, 2**32 - 1, 1 << rng.randrange(32)])
    else:
        cur = PREFIX.unpack_from(data)[("header_len", "header_hash", "data_offset", "file_size").index(field) + 3]
        value = rng.choice([0, 1, 63, 64, cur - 1, cur + 1, cur * 2, cur + R.ALIGN, cur - R.ALIGN, len(data),
                            R.MAX_HEADER, R.MAX_HEADER + 1, 2**63, 2**64 - 1, rng.randrange(2**64)]) % 2**64
    fix = rng.random() < 0.8
    return reprefix(data, fix, **{field: value}), f"prefix {field} = {value!r} (prefix checksum fixed: {fix})"


# --- mutations: forged (checksums recomputed) -----------------------------------------------


def m_header_text(rng, base, data):
    text = bytearray(json.dumps(base.header, sort_keys=True, separators=(",", ":")).encode())
    op = rng.choice(["set", "insert", "delete"])
    at = rng.randrange(len(text))
    ch = rng.choice(b'{}[]":,0123456789-.eE +tfn\\u\x00\xff')
    if op == "set":
        text[at] = ch
    elif op == "insert":
        text.insert(at, ch)
    else:
        del text[at]
    return assemble(bytes(text), data[base.data_offset:], base.data_offset), f"header text {op} {chr(ch)!r} at {at}"


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _get(node, path):
    for k in path:
        node = node[k]
    return node


def _new_value(rng, old, header, paths):
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(INTS)
    if kind == 1 and isinstance(old, int) and not isinstance(old, bool):
        return old + rng.choice([-1, 1, -2, 2, 16, -16, 64, R.ALIGN, -R.ALIGN]) if rng.random() < 0.7 else old * rng.choice([0, 2, -1, 1000])
    if kind == 2:
        return rng.choice(STRINGS)
    if kind == 3:
        return rng.choice([None, True, False, 0.5, -0.0, 1e308, float("nan"), float("inf"), [], {}, [0], {"a": 1}])
    if kind == 4:  # a value of the same type from elsewhere in the header
        same = [p for p in paths if type(_get(header, p)) is type(old)]
        return copy.deepcopy(_get(header, rng.choice(same))) if same else None
    if kind == 5 and isinstance(old, list):
        new = list(old)
        op = rng.randrange(4)
        if op == 0 and new:
            new.append(copy.deepcopy(rng.choice(new)))
        elif op == 1:
            new.reverse()
        elif op == 2 and new:
            del new[rng.randrange(len(new))]
        else:
            new.insert(0, rng.choice(INTS))
        return new
    if kind == 6:
        return Deep(rng.choice([10, 1000, 100000]), old)
    if kind == 7 and isinstance(old, str):
        return old + rng.choice(["x", "0", ".", " "]) if rng.random() < 0.5 else old[:-1]
    if kind == 8:
        return str(old) if not isinstance(old, str) else (int(old) if old.isdigit() else len(old))
    return rng.choice(INTS + [None, "x", [], {}])


def _pick_path(rng, header):
    paths = list(_paths(header))[1:]
    hot = [p for p in paths if p[0] in HOT]
    if rng.random() < 0.5:  # favour the fields a reader acts on: tensor specs, blob entries, layer meta
        keys = ("blob", "dtype", "shape", "offset", "nbytes", "kind", "xxh3_64", "in_features",
                "out_features", "bits", "has_bias", "class", "dim", "seed", "m", "p", "regenerate",
                "num_hidden_layers", "hidden_size", "vocab_size", "model_type", "tie_word_embeddings")
        hot = [p for p in paths if p and p[-1] in keys] or hot
    return paths, rng.choice(hot or paths)


def m_header_field(rng, base, data):
    header = copy.deepcopy(base.header)
    paths, path = _pick_path(rng, header)
    parent, key = _get(header, path[:-1]), path[-1]
    op = rng.randrange(6)
    if op == 0:
        del parent[key]
        what = "deleted"
    elif op == 1 and isinstance(parent, dict):
        parent[rng.choice(["extra", "tensors", "blob", "regenerate", "m", "p", "shape", str(key) + "_"])] = \
            _new_value(rng, parent[key], header, paths)
        what = "added a key next to it"
    elif op == 2:  # swap with a same-type value at another path
        other = rng.choice(paths)
        op_parent, op_key = _get(header, other[:-1]), other[-1]
        try:
            parent[key], op_parent[op_key] = op_parent[op_key], parent[key]
        except (IndexError, KeyError, TypeError):
            pass
        what = f"swapped with {other}"
    else:
        parent[key] = _new_value(rng, parent[key], header, paths)
        what = "set to " + repr(parent[key])[:80]
    return assemble(header, data[base.data_offset:], base.data_offset), f"header {list(path)} {what}"


def m_blob_forge(rng, base, data):
    header = copy.deepcopy(base.header)
    i = rng.randrange(len(header["blobs"]))
    b = header["blobs"][i]
    blobs = bytearray(data[base.data_offset:])
    if b["nbytes"]:
        at = b["offset"] + rng.randrange(b["nbytes"])
        blobs[at] ^= 1 << rng.randrange(8)
    b["xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(blobs[b["offset"]:b["offset"] + b["nbytes"]]))
    return assemble(header, bytes(blobs), base.data_offset), f"blob {i} ({b['kind']}) forged"


def m_splice(rng, base, data, other):
    """The header of one base with the blobs of the other (or the two halves of two files)."""
    if rng.random() < 0.5:
        return assemble(base.header, other.data[other.data_offset:], base.data_offset), f"header of {base.name}, blobs of {other.name}"
    at = rng.randrange(min(len(data), len(other.data)))
    return bytearray(data[:at] + other.data[at:]), f"first {at} bytes of {base.name}, rest of {other.name}"


DAMAGE = [m_bitflip, m_bitflip, m_bytes, m_truncate, m_extend, m_prefix_field]
FORGED = [m_header_text, m_header_field, m_header_field, m_header_field, m_header_field, m_blob_forge]


def mutate(rng, bases):
    """(base, mutated bytes, forged?, description) of one case."""
    base = rng.choice(bases)
    data = bytearray(base.data)
    steps, forged = [], False
    for _ in range(1 if rng.random() < 0.85 else 2):
        if len(data) < 64:  # a cut left no prefix to edit further
            break
        r = rng.random()
        if r < 0.04:
            data, what = m_splice(rng, base, data, rng.choice([b for b in bases if b is not base]))
            forged = True
        elif r < 0.5:
            data, what = rng.choice(DAMAGE)(rng, base, data)
        else:
            m = rng.choice(FORGED)
            data, what = m(rng, base, data if not steps else bytearray(base.data))
            forged = True
        steps.append(what)
    return base, bytes(data), forged, "; ".join(steps)


# --- the oracle ------------------------------------------------------------------------------


def _stored(a):
    return R._raw(a).tobytes()


def _described(data, header, spec):
    b = header["blobs"][spec["blob"]]
    start = header["_data_offset"] + b["offset"]
    return bytes(data[start:start + b["nbytes"]])


def faithful(model, data, header):
    """Why the loaded model differs from what the bytes describe, or None when it does not."""
    from mlx.utils import tree_flatten

    modules = dict(model.named_modules())
    for name, meta in header["layers"].items():
        layer = modules.get(name)
        if layer is None or type(layer).__name__ != meta["class"]:
            return f"layer {name}: {type(layer).__name__}, the file says {meta['class']}"
        lmeta, arrays = layer.to_state()
        for k in ("in_features", "out_features", "bits", "has_bias"):
            if lmeta[k] != meta[k]:
                return f"layer {name}: {k} {lmeta[k]} != {meta[k]}"
        for k in ("kind", "dim", "seed", "m", "p"):
            if k in lmeta["rotation"] and lmeta["rotation"][k] != meta["rotation"].get(k, lmeta["rotation"][k]):
                return f"layer {name}: rotation {k} differs"
        for key, spec in meta["tensors"].items():
            dtype = str(arrays[key].dtype).rsplit(".", 1)[-1]
            if dtype != spec["dtype"] or _stored(arrays[key]) != _described(data, header, spec):
                return f"layer {name}: tensor {key} differs from its blob"
    params = dict(tree_flatten(model.parameters()))
    for k, spec in header["params"].items():
        if _stored(params[k]) != _described(data, header, spec):
            return f"param {k} differs from its blob"
    args = getattr(model, "args", None)
    for k, v in (header.get("config") or {}).items():
        if args is not None and hasattr(args, k) and getattr(args, k) != v and v is not None:
            return f"config {k}: the model has {getattr(args, k)!r}, the file says {v!r}"
    return None


def classify(path, data, base, forged):
    try:
        model = R.load_reservoir(path)
    except R.ReservoirError as e:
        return "rejected", str(e).split(": ", 1)[-1][:160]
    except RecursionError as e:  # reported as its own failure, not hidden under "other"
        return "other", f"RecursionError: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - the point is to see every other exception
        return "other", f"{type(e).__name__}: {e}"[:300]
    try:
        got = logits_bytes(model)
    except Exception as e:  # noqa: BLE001
        return "unusable", f"{type(e).__name__}: {e}"[:300]
    if got == base.logits:
        return "harmless", ""
    if not forged:
        return "wrong-model", "a damaged file loaded different logits"
    header = R.read_header(path)
    why = faithful(model, data, header)
    if why:
        return "wrong-model", why
    return "as-described", ""


def run_case(ctx, seed, index):
    rng = random.Random(f"vqres:{seed}:{index}")
    base, data, forged, what = mutate(rng, ctx["bases"])
    ctx["path"].write_bytes(data)
    outcome, detail = classify(ctx["path"], data, base, forged)
    if outcome not in ("rejected", "harmless", "as-described"):
        detail = f"{base.name}: {what}: {detail}"
    return outcome, detail
