"""The reservoir: a quantized model in one flat, checksummed file (spec: docs/reservoir-format.md).

    [64-byte prefix: magic, version, header length and xxh3, data offset, file size, prefix xxh3]
    [JSON header: layers, tensors, blobs (offset, size, xxh3_64), config, persist_rotation]
    [blobs: raw little-endian tensor bytes; blobs of 16 KiB or more start on 16 KiB boundaries]

Loading reads each blob once with pread straight into an MLX-owned buffer (one copy: MLX on CPU
cannot adopt foreign memory, ``mx.asarray(copy=False)`` refuses), hashing it piece by piece while the
bytes are in the CPU cache, and builds each QuantizedLinear with ``from_state``: no QR, no Lloyd-Max
fit, no nearest-centroid search, except regenerating dense QR rotations when they were stored as
seeds. No mapping of the file is used, so a file truncated during a load gives ReservoirError, not
SIGBUS. On Linux/glibc the destination memory is prefaulted by a helper thread (``Prefault`` (vqpipe/prefault.py)).
"""

import dataclasses
import json
import math
import mmap
import os
import re
import struct
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash

from .. import __version__
from ..quant import residual_rotation
from . import zerocopy
from ..codec.codebook import BITS, LAYER_BITS
from .fsutil import atomic_path
from ..codec.bitpack import words_per_row
from ..prefault import Prefault
from ..codec.rotation import hadamard_supported, regenerate
from ..layers.fused import fuse_model
from ..codec import trellis
from ..layers.qlinear import TRELLIS_BITS, QuantizedEmbedding, trellis_params
from ..quant.quantize import build_layers, restore_head, skeleton, split_state

FILE_NAME = "model.vqres"
MAGIC = b"\x89VQRES\r\n"
VERSION = 5
# Version 2 adds per-group scales (a layer's "group_size"); a file is written as version 1 when no
# layer has them, so per-row reservoirs are byte-identical to what earlier vqpipe wrote.
# Version 3 adds layer widths beyond the model widths 2/3/4 (codebook.LAYER_BITS: a mixed
# allocation, vqpipe/codec/allocate.py); written only when a layer has one, so nothing else changes.
# Version 4 adds a QuantizedEmbedding's "head" (a residual-rotated tied head's input map,
# vqpipe/quant/residual_rotation.py: its gain and rotation); written only when a layer has one.
# Version 5 adds trellis codes (a layer's "codes" entry, vqpipe/codec/trellis.py: packed holds
# tiles of 32 rows x 8 columns, codebook the 2^L state values); written only when a layer has them.
READS = (1, 2, 3, 4, 5)
# magic, version, flags, header length, header xxh3, data offset, file size, prefix xxh3 (of bytes 0-47).
_PREFIX = struct.Struct("<8sIIQQQQQ")
PREFIX_SIZE = 64
ALIGN = 16384  # Apple silicon page size (a multiple of Linux's 4 KiB)
SMALL_ALIGN = 64  # blobs smaller than ALIGN: cache-line aligned, packed densely
MAX_HEADER = 256 << 20
CHECKSUM = "xxh3_64"
ROTATION_KINDS = ("hadamard", "kron", "qr", "none")
LAYER_CLASSES = ("QuantizedLinear", "QuantizedEmbedding")
BLOB_KINDS = ("packed", "scales", "codebook", "rotation", "bias", "param")
# Bounds on what a header can make the reader allocate or loop over (docs/reliability.md). Blob
# buffers are bounded by the file size (every blob lies inside the file); these bound the rest.
MAX_DIM = 2**31 - 1  # MLX shapes are int32
MAX_NDIM = 8
MAX_SEED = 2**64
MAX_REGENERATE_DIM = 16384  # a regenerated QR matrix: dim^2 float32 (1 GiB) and O(dim^3) work
MAX_CONFIG_COUNT = 4096  # num_hidden_layers and other counts an embedded config loops over

# name -> (MLX dtype, numpy dtype of the same bytes: numpy has no bfloat16, its bytes are uint16)
_DTYPES = {
    "float32": (mx.float32, "<f4"),
    "float16": (mx.float16, "<f2"),
    "bfloat16": (mx.bfloat16, "<u2"),
    "uint8": (mx.uint8, "u1"),
    "uint16": (mx.uint16, "<u2"),
    "uint32": (mx.uint32, "<u4"),
    "uint64": (mx.uint64, "<u8"),
    "int8": (mx.int8, "i1"),
    "int16": (mx.int16, "<i2"),
    "int32": (mx.int32, "<i4"),
    "int64": (mx.int64, "<i8"),
}
_FLOATS = ("float32", "float16", "bfloat16")


class ReservoirError(ValueError):
    """The file is not a reservoir this vqpipe can load, or it is damaged; the message says why."""


def _hash(buf):
    return xxhash.xxh3_64_hexdigest(buf)


def _dtype_name(a):
    name = str(a.dtype).rsplit(".", 1)[-1]
    if name not in _DTYPES:
        raise ValueError(f"reservoir cannot store dtype {name}")
    return name


def _raw(a):
    """The bytes of an MLX array in C order, as a flat uint8 numpy array (for writing)."""
    mx.eval(a)
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)


def _blob_kind(key):
    if key.startswith(("rotation.", "head.rotation.")):
        return "rotation"
    return "param" if key == "head.gain" else key  # a tied head's gain: a norm's weight, moved


# --- writing ---------------------------------------------------------------------------------


def _model_config(model):
    """A config.json-like dict from an mlx-lm model's ``args`` dataclass (None if it has none)."""
    args = getattr(model, "args", None)
    if args is None or not dataclasses.is_dataclass(args):
        return None
    out = {}
    for k, v in dataclasses.asdict(args).items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def build_header(metas, arrays, params, persist_rotation, config=None, residual=None):
    """(header dict, [(offset, flat uint8 numpy array)]) for a reservoir of these tensors.

    Identical bytes are stored once (every layer of one width and bit count shares a codebook).
    """
    blobs, data, seen = [], [], {}
    offset = 0

    def add(kind, a):
        nonlocal offset
        raw = _raw(a)
        key = (kind, raw.size, xxhash.xxh3_128_digest(raw))
        for i in seen.get(key, ()):
            if np.array_equal(data[i][1], raw):
                return i
        align = ALIGN if raw.size >= ALIGN else SMALL_ALIGN
        offset = -(-offset // align) * align
        blobs.append({"kind": kind, "offset": offset, "nbytes": int(raw.size), CHECKSUM: _hash(raw)})
        data.append((offset, raw))
        seen.setdefault(key, []).append(len(blobs) - 1)
        offset += raw.size
        return len(blobs) - 1

    def spec(kind, a):
        return {"blob": add(kind, a), "dtype": _dtype_name(a), "shape": [int(s) for s in a.shape]}

    layers = {}
    for name, meta in metas.items():
        entry = json.loads(json.dumps(meta))  # a deep, JSON-clean copy
        entry.setdefault("class", "QuantizedLinear")
        rot = entry["rotation"]
        prefix = name + "."
        tensors = {}
        for key in sorted(k[len(prefix):] for k in arrays if k.startswith(prefix)):
            a = arrays[prefix + key]
            if key == "rotation.matrix" and not persist_rotation:
                rot["regenerate"] = True
                rot["matrix_" + CHECKSUM] = _hash(_raw(a.astype(mx.float32)))
                continue
            tensors[key] = spec(_blob_kind(key), a)
        entry["tensors"] = tensors
        layers[name] = entry
    header = {
        "format": "vqpipe-reservoir",
        "format_version": _version_for(metas),
        "vqpipe_version": __version__,
        "persist_rotation": bool(persist_rotation),
        "checksum": CHECKSUM,
        "alignment": ALIGN,
        "config": config,
        "layers": layers,
        "params": {name: spec("param", a) for name, a in params.items()},
        "blobs": blobs,
    }
    if residual is not None:  # the residual rotation folded into the weights (vqpipe/quant/residual_rotation.py)
        header["residual_rotation"] = dict(residual)
    return header, data


def _version_for(metas):
    if any("codes" in m for m in metas.values()):
        return 5
    if any("head" in m for m in metas.values()):
        return 4
    if any(m.get("bits") not in BITS for m in metas.values()):
        return 3
    return 2 if any(m.get("group_size") is not None for m in metas.values()) else 1


def write_reservoir(path, metas, arrays, params, persist_rotation=False, config=None, residual=None):
    """Write a reservoir atomically; returns its header. ``residual``: the residual rotation folded
    into the model (vqpipe/quant/residual_rotation.py ``identity``), recorded so a graft can refuse a
    model made without it.

    The data is written and fsynced before the prefix (with the magic) goes in, and the file is
    renamed into place only after that: a writer killed at any point leaves no file that loads.
    """
    header, data = build_header(metas, arrays, params, persist_rotation, config, residual)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    data_offset = -(-(PREFIX_SIZE + len(text)) // ALIGN) * ALIGN
    end = data_offset + (data[-1][0] + data[-1][1].size if data else 0)
    head = _PREFIX.pack(MAGIC, header["format_version"], 0, len(text), xxhash.xxh3_64_intdigest(text), data_offset, end, 0)
    prefix = head[:48] + struct.pack("<Q", xxhash.xxh3_64_intdigest(head[:48]))
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(bytes(PREFIX_SIZE))
            f.write(text)
            for offset, raw in data:
                f.seek(data_offset + offset)
                f.write(memoryview(raw))
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            f.write(prefix.ljust(PREFIX_SIZE, b"\0"))
    header["_data_offset"], header["_file_size"] = data_offset, end
    return header


def save_reservoir(model, path, persist_rotation=False, config=None):
    """Write ``model`` (quantized in memory) to the reservoir file ``path``; returns the header.

    ``config`` (the model's config.json) is embedded so the file alone can rebuild the model; by
    default it is derived from the mlx-lm model's ``args``.
    """
    metas, arrays, params = split_state(model)
    if not metas:
        raise ValueError("model has no QuantizedLinear layers: quantize it first")
    return write_reservoir(_file(path), metas, arrays, params, persist_rotation,
                           config if config is not None else _model_config(model), residual_rotation.of(model))


# --- reading ---------------------------------------------------------------------------------


def _fail(path, msg):
    raise ReservoirError(f"{path}: {msg}")


def _is_int(x, low=0):
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _read_prefix(path, f, size):
    if size < PREFIX_SIZE:
        _fail(path, f"not a reservoir: {size} bytes is shorter than the {PREFIX_SIZE}-byte prefix")
    raw = f.read(PREFIX_SIZE)
    if len(raw) != PREFIX_SIZE:
        _fail(path, "short read of the prefix")
    magic, version, flags, header_len, header_hash, data_offset, file_size, prefix_hash = _PREFIX.unpack(raw[:56])
    if magic != MAGIC:
        what = "a partially written reservoir (no magic yet)" if magic == bytes(8) else f"magic {magic!r}"
        _fail(path, f"not a vqpipe reservoir: {what}, expected {MAGIC!r}")
    if version not in READS:
        _fail(path, f"unsupported reservoir format version {version}; "
                    f"this vqpipe {__version__} reads versions {', '.join(map(str, READS))}")
    if xxhash.xxh3_64_intdigest(raw[:48]) != prefix_hash:
        _fail(path, "prefix checksum mismatch: the first 64 bytes are corrupted")
    if flags or raw[56:] != bytes(PREFIX_SIZE - 56):
        _fail(path, f"unknown flags {flags:#x} or non-zero reserved prefix bytes (corrupted, or a newer vqpipe?)")
    if file_size != size:
        state = "truncated" if size < file_size else "has trailing bytes"
        _fail(path, f"file is {state}: {size} bytes on disk, the prefix says {file_size}")
    if header_len > MAX_HEADER or PREFIX_SIZE + header_len > size:
        _fail(path, f"header length {header_len} is out of bounds (file {size} bytes, limit {MAX_HEADER})")
    if data_offset < PREFIX_SIZE + header_len or data_offset > size or data_offset % ALIGN:
        _fail(path, f"data offset {data_offset} is out of bounds or not {ALIGN}-aligned")
    return header_len, header_hash, data_offset, version


def _check_spec(path, where, spec, blobs):
    if not isinstance(spec, dict) or not _is_int(spec.get("blob")) or spec["blob"] >= len(blobs):
        _fail(path, f"malformed header: {where} has no valid blob index")
    dtype, shape = spec.get("dtype"), spec.get("shape")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        _fail(path, f"malformed header: {where} has unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s) and s <= MAX_DIM for s in shape):
        _fail(path, f"malformed header: {where} has invalid shape {str(shape)[:80]} "
                    f"(at most {MAX_NDIM} dimensions of at most {MAX_DIM})")
    itemsize = np.dtype(_DTYPES[dtype][1]).itemsize
    blob = blobs[spec["blob"]]
    if math.prod(shape) * itemsize != blob["nbytes"]:
        _fail(path, f"malformed header: {where} {dtype}{shape} needs {math.prod(shape) * itemsize} bytes, "
                    f"blob {spec['blob']} holds {blob['nbytes']}")
    if blob["offset"] % itemsize:
        _fail(path, f"malformed header: {where} blob offset {blob['offset']} is not {itemsize}-byte aligned")


def _expected_layer_tensors(meta):
    """{key: (shape, dtype or None for any float)} a layer's meta implies."""
    n_in, n_out, bits, rot = meta["in_features"], meta["out_features"], meta["bits"], meta["rotation"]
    out = {
        "packed": ([n_out, words_per_row(n_in, bits)], "uint32"),
        "scales": ([n_out], None) if meta.get("group_size") is None else ([n_out, n_in // meta["group_size"]], None),
        "codebook": ([1 << bits], None),
    }
    if "codes" in meta:  # trellis: tiles of 32 rows x 8 columns, k bits a weight; the 2^L state values
        out["packed"] = ([n_out // trellis.TILE_ROWS, n_in // trellis.GROUP * trellis.GROUP * bits], "uint32")
        out["codebook"] = ([1 << meta["codes"]["L"]], None)
    if meta["has_bias"]:
        out["bias"] = ([n_out], None)
    out.update(_rotation_tensors(rot, "rotation."))
    if "head" in meta:
        out["head.gain"] = ([n_in], None)
        out.update(_rotation_tensors(meta["head"]["rotation"], "head.rotation."))
    return out


def _rotation_tensors(rot, prefix):
    kind, dim = rot["kind"], rot["dim"]
    if kind == "hadamard":
        return {prefix + "signs": ([dim], None)}
    if kind == "kron":
        return {prefix + "signs": ([rot["p"]], None), prefix + "q": ([rot["m"], rot["m"]], None)}
    if kind == "qr" and not rot.get("regenerate"):
        return {prefix + "matrix": ([dim, dim], None)}
    return {}


def _check_layer(path, name, meta, blobs):
    where = f"layer {name!r}"
    if not isinstance(meta, dict) or meta.get("class") not in LAYER_CLASSES:
        _fail(path, f"malformed header: {where} has no known class")
    for k in ("in_features", "out_features"):
        if not _is_int(meta.get(k), 1) or meta[k] > MAX_DIM:
            _fail(path, f"malformed header: {where} has invalid {k}")
    if meta.get("bits") not in LAYER_BITS or not isinstance(meta.get("has_bias"), bool):
        _fail(path, f"malformed header: {where} has invalid bits or has_bias")
    gs = meta.get("group_size")
    if gs is not None and not (_is_int(gs, 1) and meta["in_features"] % gs == 0):
        _fail(path, f"malformed header: {where} group_size {gs!r} does not divide in_features {meta['in_features']}")
    if "dtype" in meta and meta["dtype"] not in _FLOATS:  # a QuantizedEmbedding's lookup dtype
        _fail(path, f"malformed header: {where} has dtype {meta['dtype']!r}, expected one of {', '.join(_FLOATS)}")
    if "codes" in meta:
        _check_codes(path, where, meta)
    rot = meta.get("rotation")
    _check_rotation(path, where, rot, meta["in_features"])
    if "head" in meta:
        head = meta["head"]
        if meta["class"] != "QuantizedEmbedding" or not isinstance(head, dict) or set(head) != {"rotation"}:
            _fail(path, f"malformed header: {where} has a 'head' that is not a QuantizedEmbedding's {{rotation}}")
        _check_rotation(path, f"{where} head", head["rotation"], meta["in_features"])
        if head["rotation"]["kind"] not in ("hadamard", "kron") or "regenerate" in head["rotation"]:
            _fail(path, f"malformed header: {where} head rotation is {head['rotation']['kind']!r}, "
                        "expected a stored hadamard or kron rotation")
    if not isinstance(rot.get("regenerate", False), bool):
        _fail(path, f"malformed header: {where} rotation 'regenerate' is not a boolean")
    if rot.get("regenerate"):
        if rot["kind"] != "qr" or not isinstance(rot.get("matrix_" + CHECKSUM), str):
            _fail(path, f"malformed header: {where} is marked regenerate without a qr matrix checksum")
        if rot["dim"] > MAX_REGENERATE_DIM:
            _fail(path, f"malformed header: {where} asks to regenerate a {rot['dim']}x{rot['dim']} QR rotation; "
                        f"this reader regenerates at most {MAX_REGENERATE_DIM} (store it: persist_rotation on)")
    tensors = meta.get("tensors")
    expected = _expected_layer_tensors(meta)
    if not isinstance(tensors, dict) or set(tensors) != set(expected):
        got = sorted(tensors) if isinstance(tensors, dict) else tensors
        _fail(path, f"malformed header: {where} has tensors {got}, expected {sorted(expected)}")
    for key, (shape, dtype) in expected.items():
        spec = tensors[key]
        _check_spec(path, f"{where} tensor {key!r}", spec, blobs)
        dtype_ok = spec["dtype"] == dtype if dtype else spec["dtype"] in _FLOATS
        if spec["shape"] != shape or not dtype_ok:
            _fail(path, f"malformed header: {where} tensor {key!r} is {spec['dtype']}{spec['shape']}, "
                        f"expected {dtype or 'a float'}{shape}")


def _check_codes(path, where, meta):
    try:
        L, _ = trellis_params(meta)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        _fail(path, f"malformed header: {where} has codes {meta['codes']!r} ({e})")
    if not (_is_int(L, 1) and meta["bits"] <= L <= 16 and meta["bits"] in TRELLIS_BITS
            and meta.get("group_size") is None and not meta["out_features"] % trellis.TILE_ROWS
            and not meta["in_features"] % trellis.GROUP):
        _fail(path, f"malformed header: {where} has trellis codes at {meta['bits']} bits, L {L}, shape "
                    f"({meta['out_features']}, {meta['in_features']}), group size {meta.get('group_size')}: not decodable")


def _check_rotation(path, where, rot, dim):
    if not isinstance(rot, dict) or rot.get("kind") not in ROTATION_KINDS:
        _fail(path, f"malformed header: {where} has an unknown rotation kind")
    if rot.get("dim") != dim or not _is_int(rot.get("seed")) or rot["seed"] >= MAX_SEED:
        _fail(path, f"malformed header: {where} rotation dim/seed invalid")
    factors_ok = _is_int(rot.get("m"), 1) and _is_int(rot.get("p"), 1) and rot["m"] * rot["p"] == rot["dim"]
    if rot["kind"] == "kron" and not (factors_ok and hadamard_supported(rot["p"])):
        _fail(path, f"malformed header: {where} kron factors do not multiply to {rot['dim']} "
                    "with a Hadamard size p")
    if rot["kind"] == "hadamard" and not hadamard_supported(rot["dim"]):
        _fail(path, f"malformed header: {where} has a hadamard rotation of unsupported size {rot['dim']}")


def _check_header(path, h, size, data_offset):
    if not isinstance(h, dict) or h.get("format") != "vqpipe-reservoir":
        _fail(path, "malformed header: not a vqpipe-reservoir header")
    if h.get("format_version") not in READS or h.get("checksum") != CHECKSUM:
        _fail(path, f"unsupported header: format_version {h.get('format_version')!r}, checksum {h.get('checksum')!r}")
    blobs = h.get("blobs")
    if not isinstance(blobs, list):
        _fail(path, "malformed header: no blob table")
    for i, b in enumerate(blobs):
        if not (isinstance(b, dict) and _is_int(b.get("offset")) and _is_int(b.get("nbytes"))
                and isinstance(b.get(CHECKSUM), str) and b.get("kind") in BLOB_KINDS):
            _fail(path, f"malformed header: blob {i} entry is invalid")
        start = data_offset + b["offset"]
        if start + b["nbytes"] > size:
            _fail(path, f"blob {i} ({b['kind']}) at {start} + {b['nbytes']} bytes runs past the end "
                        f"of the {size}-byte file")
    if not isinstance(h.get("layers"), dict) or not isinstance(h.get("params"), dict):
        _fail(path, "malformed header: no layers/params tables")
    if not isinstance(h.get("persist_rotation"), bool):
        _fail(path, "malformed header: persist_rotation is not a boolean")
    res = h.get("residual_rotation")
    if res is not None and not (isinstance(res, dict) and set(res) == {"kind", "dim", "seed"}
                                and res["kind"] in ("hadamard", "kron") and _is_int(res["dim"], 1)
                                and res["dim"] <= MAX_DIM and _is_int(res["seed"]) and res["seed"] < MAX_SEED):
        _fail(path, "malformed header: residual_rotation is not {kind: hadamard|kron, dim, seed}")
    for name, meta in h["layers"].items():
        _check_layer(path, name, meta, blobs)
        if meta.get("group_size") is not None and h["format_version"] < 2:
            _fail(path, f"malformed header: layer {name!r} has group scales in a version 1 file")
        if "head" in meta and h["format_version"] < 4:
            _fail(path, f"malformed header: layer {name!r} has a head in a version {h['format_version']} file "
                        "(version 4 and later)")
        if meta["bits"] not in BITS and h["format_version"] < 3:
            _fail(path, f"malformed header: layer {name!r} has {meta['bits']} bits in a version "
                        f"{h['format_version']} file (version 3 and later)")
    for name, spec in h["params"].items():
        _check_spec(path, f"param {name!r}", spec, blobs)


def _reject_constant(name):
    raise ValueError(f"non-finite number {name} in JSON")


def read_header(path):
    """The validated header of a reservoir file, plus ``"_data_offset"`` and ``"_file_size"``."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ReservoirError(f"{path}: cannot open: {e.strerror}") from e
    with f:
        st = os.fstat(f.fileno())
        size = st.st_size
        header_len, header_hash, data_offset, version = _read_prefix(path, f, size)
        text = f.read(header_len)
    if len(text) != header_len:
        _fail(path, "short read of the header")
    if xxhash.xxh3_64_intdigest(text) != header_hash:
        _fail(path, "header checksum mismatch: the JSON header is corrupted")
    try:
        header = json.loads(text.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _fail(path, f"malformed header: {e}")
    _check_header(path, header, size, data_offset)
    if header["format_version"] != version:
        _fail(path, f"malformed header: format_version {header['format_version']} but the prefix says {version}")
    header["_data_offset"], header["_file_size"] = data_offset, size
    header["_identity"] = _identity(st)
    return header


def _identity(st):
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


class _Replaced(Exception):
    """The file at the path is not the one whose header was read (a writer replaced it since)."""


def _retry_replaced(path, fn, *args):
    """``fn(*args)``, again if a writer replaced the file between reading the header and the blobs:
    a reader gets the old model or the new one, never a mix (and no spurious checksum error)."""
    for _ in range(5):
        try:
            return fn(*args)
        except _Replaced:
            continue
    _fail(path, "the file was replaced by a writer during each of 5 load attempts")


# --- the reader --------------------------------------------------------------------------------


_READ_CHUNK = 4 << 20  # read and hash in pieces this size, each hashed while still in the CPU cache


def _prefault_for(header, layers=True, params=True):
    """A ``Prefault`` (vqpipe/prefault.py) context sized for the blobs a load of these parts will read."""
    ids = set()
    if layers:
        ids.update(s["blob"] for m in header["layers"].values() for s in m["tensors"].values())
    if params:
        ids.update(s["blob"] for s in header["params"].values())
    return Prefault(sum(header["blobs"][i]["nbytes"] + 64 for i in ids))


def _read_blob(path, fd, i, blob, start, dtype, shape, prefault=None):
    """Blob ``i`` as an evaluated MLX array: pread straight into an MLX-owned buffer, hashed piecewise.

    Returns ``(array, xxh3 hex digest)``. A short read (the file was truncated while we read it)
    raises ReservoirError; no mapping of the file exists, so nothing can fault.
    """
    n = blob["nbytes"]
    a = mx.zeros(shape, dtype=dtype)  # MLX has no uninitialised allocation; zeroing is one cheap pass
    mx.eval(a)
    h = xxhash.xxh3_64()
    mv = memoryview(a).cast("B") if n else memoryview(b"")
    try:
        if prefault is not None:
            prefault.check(mv)
        done = 0
        while done < n:
            got = os.preadv(fd, [mv[done:done + _READ_CHUNK]], start + done)
            if got <= 0:
                _fail(path, f"short read in blob {i} ({blob['kind']}, {n} bytes at offset {start}): "
                            f"the file ends at {start + done}; it was truncated while being loaded")
            h.update(mv[done:done + got])
            done += got
    finally:
        mv.release()
    return a, h.hexdigest()


def _reader(path, header, prefault=None):
    """``(read, close)``: read(spec) -> mx.array; close() ends the reading.

    Each blob is read once with pread into an MLX-owned buffer of the tensor's dtype and shape (one
    copy, page cache -> MLX memory), hashed piece by piece while those bytes are in the CPU cache and
    checked before use; a blob shared by several tensors is read once (other dtypes or shapes of it
    are views of the same buffer). ``prefault``: the ``Prefault`` (vqpipe/prefault.py) the caller entered, if any.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ReservoirError(f"{path}: cannot open: {e.strerror}") from e
    if "_identity" in header and _identity(os.fstat(fd)) != header["_identity"]:
        os.close(fd)
        raise _Replaced(path)
    base, blobs, raw, out = header["_data_offset"], header["blobs"], {}, {}
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if zerocopy.wanted() else None  # private mapping
    except BaseException:
        os.close(fd)
        raise

    def read(spec):
        key = (spec["blob"], spec["dtype"], tuple(spec["shape"]))
        if key in out:
            return out[key]
        i, dtype, shape = spec["blob"], _DTYPES[spec["dtype"]][0], spec["shape"]
        if i in raw:
            a = raw[i].reshape(-1).view(dtype).reshape(shape)  # no copy: the same buffer
        else:
            blob = blobs[i]
            start = base + blob["offset"]
            a = zerocopy.adopt(mm, start, blob["nbytes"]) if mm is not None and blob["nbytes"] >= ALIGN else None
            if a is not None:
                digest = _hash(a)
                a = a.view(dtype).reshape(shape)
            elif dtype == mx.bfloat16:  # no buffer protocol for bfloat16: read its bytes as uint16
                a, digest = _read_blob(path, fd, i, blob, start, mx.uint16, shape, prefault)
                a = a.view(mx.bfloat16)
            else:
                a, digest = _read_blob(path, fd, i, blob, start, dtype, shape, prefault)
            if digest != blob[CHECKSUM]:
                _fail(path, f"checksum mismatch in blob {i} ({blob['kind']}, {blob['nbytes']} bytes "
                            f"at offset {start}): the data is corrupted")
            raw[i] = a
        out[key] = a
        return a

    def close():
        raw.clear()
        out.clear()
        os.close(fd)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # adopted arrays still use the mapping: it lives as long as they do
                pass

    return read, close


def _regenerate(path, name, rmeta, memo):
    key = (rmeta["dim"], rmeta["seed"])
    if key not in memo:
        r = regenerate(rmeta)
        got, want = _hash(_raw(r.matrix)), rmeta["matrix_" + CHECKSUM]
        if got != want:
            _fail(path, f"layer {name!r}: the dense QR rotation regenerated from seed {rmeta['seed']} (dim "
                        f"{rmeta['dim']}) differs from the one used at quantization ({CHECKSUM} {got} != {want}); "
                        "this numpy/LAPACK build does not reproduce it: repack with persist_rotation on")
        memo[key] = r.matrix
    return memo[key]


def _build_layers(path, header, read, names=None):
    layers, memo = {}, {}
    for name, meta in header["layers"].items():
        if names is not None and name not in names:
            continue
        arrays = {f"{name}.{k}": read(spec) for k, spec in meta["tensors"].items()}
        if meta["rotation"].get("regenerate"):
            arrays[f"{name}.rotation.matrix"] = _regenerate(path, name, meta["rotation"], memo)
        layers.update(build_layers({name: meta}, arrays))
    return layers


def _target_shape(module):
    """[out, in] of a module a quantized layer can replace (Linear, Embedding, their MLX-quantized forms)."""
    if hasattr(module, "in_features"):
        return [module.out_features, module.in_features]
    if "weight" not in module:
        return None
    rows, cols = module["weight"].shape[0], module["weight"].shape[-1]
    if "scales" in module and hasattr(module, "bits"):  # mlx affine: cols are packed uint32 words
        cols = cols * 32 // module.bits
    return [rows, cols]


def _check_targets(path, model, layers):
    import mlx.nn as nn

    embeddings = (nn.Embedding, nn.QuantizedEmbedding, QuantizedEmbedding)
    modules = dict(model.named_modules())
    for name, meta in layers.items():
        if name not in modules:
            _fail(path, f"layer {name!r} has no module of that name in {type(model).__name__}")
        want = [meta["out_features"], meta["in_features"]]
        got = _target_shape(modules[name])
        if got != want:
            _fail(path, f"layer {name!r} is {want[0]}x{want[1]} in the reservoir but {got} in the model")
        if isinstance(modules[name], embeddings) != (meta["class"] == "QuantizedEmbedding"):
            _fail(path, f"layer {name!r} is a {meta['class']} in the reservoir but a "
                        f"{type(modules[name]).__name__} in the model")


def _check_params(path, model, header):
    from mlx.utils import tree_flatten

    layers = header["layers"]
    expected = {}
    for k, v in tree_flatten(model.parameters()):
        owner = k.rsplit(".", 1)[0]
        while owner and owner not in layers:
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        if not owner:
            expected[k] = (list(v.shape), mx.issubdtype(v.dtype, mx.floating))
    stored = header["params"]
    missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or extra:
        _fail(path, f"does not match the model config: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, (shape, floating) in expected.items():
        if stored[k]["shape"] != shape:
            _fail(path, f"param {k!r} is {stored[k]['shape']} in the reservoir but {shape} in the model")
        if (stored[k]["dtype"] in _FLOATS) != floating:
            _fail(path, f"param {k!r} is {stored[k]['dtype']} in the reservoir; the model needs "
                        f"{'a float' if floating else 'an integer'} dtype")


def _file(path):
    path = Path(path)
    return path / FILE_NAME if path.is_dir() else path


def _skeleton(path, header, model_dir):
    model_dir = Path(model_dir) if model_dir is not None else path.parent
    if (model_dir / "config.json").is_file():
        return skeleton(model_dir)
    if not isinstance(header.get("config"), dict):
        _fail(path, f"no config.json in {model_dir} and no config embedded in the reservoir")
    _check_config(path, header)
    with tempfile.TemporaryDirectory(prefix="vqres-config-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(header["config"]))
        try:
            return skeleton(tmp)
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - mlx-lm raises anything on a bad config: name the file
            _fail(path, f"the embedded config does not build an mlx-lm model: {type(e).__name__}: {str(e)[:200]}")


_COUNT_KEY = re.compile(r"(num|n)_\w+|\w*layers")


def _check_config(path, header):
    """An embedded config is untrusted input to mlx-lm's model constructors: a known model_type
    name, no custom code (model_file) or affine quantization, every integer bounded, and counts
    the constructors loop over (num_hidden_layers, ...) bounded by the header's own size."""
    config = header["config"]
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", model_type):
        _fail(path, f"embedded config: model_type {str(model_type)[:40]!r} is not a model type name")
    for key in ("model_file", "quantization", "quantization_config"):
        if key in config:
            _fail(path, f"embedded config: {key!r} is not allowed in a reservoir (vqpipe never writes it)")
    n_tensors = len(header["params"]) + sum(len(m["tensors"]) for m in header["layers"].values())
    todo = [("", config)]
    while todo:
        where, node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            name = f"{where}.{k}" if where else str(k)
            if isinstance(v, (dict, list)):
                todo.append((name, v))
            elif isinstance(v, int) and not isinstance(v, bool):
                limit = MAX_CONFIG_COUNT if isinstance(k, str) and _COUNT_KEY.fullmatch(k) else MAX_DIM
                if k == "num_hidden_layers":
                    limit = min(limit, n_tensors)
                if abs(v) > limit:
                    _fail(path, f"embedded config: {name} = {v} is out of bounds (limit {limit})")


def load_reservoir(path, model_dir=None):
    """The quantized model stored in a reservoir file (or a directory holding ``model.vqres``).

    The skeleton comes from ``model_dir``/config.json (default: the file's directory), else from
    the config embedded in the file. Its lazily initialised weights are replaced before they are
    ever evaluated.
    """
    path = _file(path)
    return _retry_replaced(path, _load_once, path, model_dir)


def _load_once(path, model_dir):
    header = read_header(path)
    with _prefault_for(header) as prefault:  # starts now: the skeleton and checks overlap it
        model = _skeleton(path, header, model_dir)
        restore_head(model, "lm_head" in header["layers"] or "lm_head.weight" in header["params"])
        _check_targets(path, model, header["layers"])
        _check_params(path, model, header)
        read, close = _reader(path, header, prefault)
        try:
            layers = _build_layers(path, header, read)
            params = {k: read(spec) for k, spec in header["params"].items()}
        finally:
            close()
    from mlx.utils import tree_unflatten

    model.update_modules(tree_unflatten(list(layers.items())))
    model.load_weights(list(params.items()), strict=False)
    mx.eval(model.parameters())
    residual_rotation.mark(model, header.get("residual_rotation"))
    fuse_model(model)  # q/k/v and gate/up as one computation where they share a rotation
    return model


def graft_reservoir(model, path):
    """Swap the reservoir's quantized layers into an already loaded ``model``, by module name.

    Only layer blobs are read; the model's other parameters are left as they are.
    """
    from mlx.utils import tree_unflatten

    path = _file(path)
    model.update_modules(tree_unflatten(list(_retry_replaced(path, _graft_layers, model, path).items())))
    fuse_model(model)
    return model


def _graft_layers(model, path):
    header = read_header(path)
    _check_targets(path, model, header["layers"])
    want, have = header.get("residual_rotation"), residual_rotation.of(model)
    if want != have:  # the layers read and write the stream in their basis: the rest must match
        _fail(path, f"its layers were quantized with residual rotation {want}, the model has {have}: "
                    "load the reservoir whole (load_reservoir) instead of grafting it")
    with _prefault_for(header, params=False) as prefault:
        read, close = _reader(path, header, prefault)
        try:
            return _build_layers(path, header, read)
        finally:
            close()


def load(path):
    """``(model, tokenizer)`` from a reservoir directory (model.vqres + config + tokenizer files)."""
    from mlx_lm.utils import load_config, load_tokenizer

    path = Path(path)
    directory = path if path.is_dir() else path.parent
    model = load_reservoir(_file(path))
    config = load_config(directory) if (directory / "config.json").is_file() else {}
    return model, load_tokenizer(directory, eos_token_ids=config.get("eos_token_id"))


# --- inspection ------------------------------------------------------------------------------


def verify_blobs(path, header=None):
    """[(blob index, ok)] for every blob, hashing the file's bytes (no model is built).

    Reads with pread through one reused buffer (no mapping: a file truncated meanwhile raises
    ReservoirError instead of faulting).
    """
    path = _file(path)
    header = header or read_header(path)
    base, out = header["_data_offset"], []
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        fd = f.fileno()
        for i, b in enumerate(header["blobs"]):
            start, n, done, h = base + b["offset"], b["nbytes"], 0, xxhash.xxh3_64()
            while done < n:
                got = os.preadv(fd, [view[:min(_READ_CHUNK, n - done)]], start + done)
                if got <= 0:
                    _fail(path, f"short read in blob {i} ({b['kind']}, {n} bytes at offset {start}): "
                                "the file was truncated while being read")
                h.update(view[:got])
                done += got
            out.append((i, h.hexdigest() == b[CHECKSUM]))
    view.release()
    return out


def sizes(header):
    """Byte accounting: stored bytes per blob kind, the ideal payload and file / ideal.

    Ideal payload = bits * weights / 8 (no row padding) + row norms (scales) + every tensor that is
    not quantized (biases, embeddings, norms); codebooks, rotations, padding and header are overhead.
    """
    by_kind = dict.fromkeys(BLOB_KINDS, 0)
    for b in header["blobs"]:
        by_kind[b["kind"]] += b["nbytes"]
    weights = sum(m["in_features"] * m["out_features"] for m in header["layers"].values())
    packed_ideal = sum(m["bits"] * m["in_features"] * m["out_features"] for m in header["layers"].values()) / 8
    ideal = packed_ideal + by_kind["scales"] + by_kind["bias"] + by_kind["param"]
    file_bytes = header.get("_file_size")
    out = {
        "file_bytes": file_bytes,
        "header_bytes": header.get("_data_offset"),
        "blob_bytes": by_kind,
        "quantized_weights": weights,
        "ideal_payload_bytes": ideal,
        "file_over_ideal": file_bytes / ideal if file_bytes and ideal else None,
        "n_blobs": len(header["blobs"]),
        "n_tensors": sum(len(m["tensors"]) for m in header["layers"].values()) + len(header["params"]),
    }
    return out
