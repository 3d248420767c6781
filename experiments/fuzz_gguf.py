"""Fuzz target for the ``gguf:`` source (``experiments.fuzz``; campaign: scripts/fuzz.py gguf).

A tiny llama GGUF (F32, F16, Q8_0, Q4_0 and Q4_1 tensors, so MLX's native reader is the one that
loads it, plus a byte-level BPE tokenizer in the metadata) is mutated, one seeded mutation per
case, and converted with ``download.fetch("gguf:FILE")``. Outcomes: ``rejected`` (ValueError or
another error naming the file), ``converted``; failures: ``other`` (any other exception),
``crash`` (the worker died, e.g. a native parser's segfault) and ``hang``.

Mutations: bit flips, byte overwrites, truncations, extensions (damage); header counts and
version set to edge values; structure-aware rewrites of the metadata (a value's type, a string
or array length, an array's element type, an entry deleted, duplicated, or a known key set to an
edge value, general.alignment added) and of the tensor infos (dimension count, dimensions, type,
offset, name), re-serialized so that everything else stays consistent.
"""

import random
import shutil
import struct
from pathlib import Path

import numpy as np

INTS = [0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 64, 255, 256, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1,
        2**32, 2**63 - 1, 2**63, 2**64 - 1]
DIMS = {"hidden": 32, "heads": 2, "kv": 1, "ff": 64}


def write_base(path):
    """The base GGUF (llama, one block) with the gguf package's writer."""
    import gguf
    from tokenizers import pre_tokenizers

    Q = gguf.GGMLQuantizationType
    merges = ["Ġ t", "h e", "Ġt he", "l l"]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges]
    rng = np.random.default_rng(0)
    h, ff, d, v = DIMS["hidden"], DIMS["ff"], DIMS["hidden"] // DIMS["heads"], len(tokens)
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, h),
                       (w.add_feed_forward_length, ff), (w.add_head_count, DIMS["heads"]),
                       (w.add_head_count_kv, DIMS["kv"]), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_rope_freq_base, 10000.0), (w.add_rope_dimension_count, d),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "smollm"), (w.add_token_list, tokens),
                       (w.add_token_types, [3] * len(special) + [1] * (v - len(special))),
                       (w.add_token_merges, merges), (w.add_bos_token_id, 1), (w.add_eos_token_id, 2)):
        add(value)
    tensors = {
        "token_embd.weight": (r(v, h), None), "output_norm.weight": (1 + r(h) * 0.1, None),
        "output.weight": (r(v, h), np.float16), "blk.0.attn_norm.weight": (1 + r(h) * 0.1, None),
        "blk.0.ffn_norm.weight": (1 + r(h) * 0.1, None), "blk.0.attn_q.weight": (r(h, h), Q.Q4_0),
        "blk.0.attn_k.weight": (r(DIMS["kv"] * d, h), Q.Q4_1), "blk.0.attn_v.weight": (r(DIMS["kv"] * d, h), Q.Q8_0),
        "blk.0.attn_output.weight": (r(h, h), np.float16), "blk.0.ffn_gate.weight": (r(ff, h), Q.Q4_0),
        "blk.0.ffn_up.weight": (r(ff, h), Q.Q8_0), "blk.0.ffn_down.weight": (r(h, ff), None),
    }
    for name, (x, kind) in tensors.items():
        if kind is None:
            w.add_tensor(name, x)
        elif kind is np.float16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- parsing the base into parts, and writing parts back -------------------------------------


SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip(buf, pos, vtype):
    if vtype in SCALAR:
        return pos + SCALAR[vtype]
    if vtype == 8:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    etype, n = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in SCALAR:
        return pos + n * SCALAR[etype]
    for _ in range(n):
        pos = _skip(buf, pos, etype)
    return pos


def parse(buf):
    """(version, [(key, vtype, value bytes)], [(name, dims, type, offset)], data bytes, alignment)."""
    version, n_t, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos, kvs = 24, []
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", buf, pos)
        end = _skip(buf, pos + 4, vtype)
        kvs.append((key, vtype, bytes(buf[pos + 4:end])))
        pos = end
    tensors = []
    for _ in range(n_t):
        (n,) = struct.unpack_from("<Q", buf, pos)
        name = buf[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        (nd,) = struct.unpack_from("<I", buf, pos)
        dims = list(struct.unpack_from(f"<{nd}Q", buf, pos + 4))
        ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * nd)
        pos += 4 + 8 * nd + 12
        tensors.append([name, dims, ttype, offset])
    start = -(-pos // 32) * 32
    return version, kvs, tensors, bytes(buf[start:])


def _str(s):
    raw = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def serialize(version, kvs, tensors, data, alignment=32, counts=None):
    n_t, n_kv = counts or (len(tensors), len(kvs))
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, n_t, n_kv))
    for key, vtype, value in kvs:
        out += _str(key) + struct.pack("<I", vtype) + value
    for name, dims, ttype, offset in tensors:
        out += _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d % 2**64) for d in dims)
        out += struct.pack("<IQ", ttype % 2**32, offset % 2**64)
    out += bytes(-len(out) % alignment)
    return bytes(out + data)


# --- mutations ---------------------------------------------------------------------------------


def m_bitflip(rng, base):
    data = bytearray(base["bytes"])
    hi = base["header_end"] if rng.random() < 0.7 else len(data)
    for _ in range(rng.choice([1, 1, 2, 4, 16])):
        data[rng.randrange(hi)] ^= 1 << rng.randrange(8)
    return bytes(data), "bitflip"


def m_bytes(rng, base):
    data = bytearray(base["bytes"])
    at = rng.randrange(base["header_end"])
    n = rng.choice([1, 4, 8, 64])
    data[at:at + n] = (rng.choice([b"\x00", b"\xff", b"\x7f"]) * n)[:len(data[at:at + n])]
    return bytes(data), f"{n} bytes at {at}"


def m_truncate(rng, base):
    at = rng.randrange(len(base["bytes"])) if rng.random() < 0.5 else rng.randrange(base["header_end"] + 64)
    return base["bytes"][:at], f"truncated at {at}"


def m_extend(rng, base):
    return base["bytes"] + bytes(rng.choice([1, 31, 4096])), "extended"


def m_header(rng, base):
    data = bytearray(base["bytes"])
    field, fmt, at = rng.choice([("version", "<I", 4), ("tensor count", "<Q", 8), ("metadata count", "<Q", 16)])
    value = rng.choice(INTS + [1, 2, 3, 4]) % (2**32 if fmt == "<I" else 2**64)
    struct.pack_into(fmt, data, at, value)
    return bytes(data), f"{field} = {value}"


def _edge_value(rng, vtype):
    if vtype in (4, 5, 10, 11, 0, 1, 2, 3):
        size = SCALAR[vtype]
        return (rng.choice(INTS) % 2 ** (8 * size)).to_bytes(size, "little")
    if vtype in (6, 12):
        return struct.pack("<f" if vtype == 6 else "<d", rng.choice([0.0, -1.0, 1e38, float("nan"), float("inf")]))
    if vtype == 8:
        return _str(rng.choice(["", "llama", "qwen2", "mamba", "gpt2", "x" * 300, "\udcff"]))
    return struct.pack("<IQ", rng.choice([4, 8, 9, 13, 2**31]), rng.choice(INTS) % 2**64)


def m_metadata(rng, base):
    version, kvs, tensors, data = base["parts"]
    kvs = list(kvs)
    i = rng.randrange(len(kvs))
    key, vtype, value = kvs[i]
    op = rng.randrange(8)
    if op == 0:
        kvs[i] = (key, rng.choice([0, 4, 6, 7, 8, 9, 10, 12, 13, 2**31]), value)
        what = "value type changed"
    elif op == 1:
        del kvs[i]
        what = "deleted"
    elif op == 2:
        kvs.insert(rng.randrange(len(kvs) + 1), kvs[i])
        what = "duplicated"
    elif op == 3 and vtype in (8, 9):
        at = 0 if vtype == 8 else 4
        n = rng.choice(INTS)
        value = value[:at] + struct.pack("<Q", n % 2**64) + value[at + 8:]
        kvs[i] = (key, vtype, value)
        what = f"length set to {n}"
    elif op == 4 and vtype == 9:
        kvs[i] = (key, vtype, struct.pack("<I", rng.choice([0, 4, 7, 8, 9, 12, 13])) + value[4:])
        what = "element type changed"
    elif op == 5:
        kvs.append(("general.alignment", 4, struct.pack("<I", rng.choice([0, 1, 3, 8, 64, 4096, 2**31]))))
        what = "general.alignment added"
    else:
        kvs[i] = (key, vtype, _edge_value(rng, vtype))
        what = "value set to an edge value"
    counts = None if rng.random() < 0.9 else (len(tensors), len(kvs) + rng.choice([-1, 1]))
    return serialize(version, kvs, tensors, data, counts=counts), f"metadata {key!r}: {what}"


def m_tensor(rng, base):
    version, kvs, tensors, data = base["parts"]
    tensors = [list(t) for t in tensors]
    t = rng.choice(tensors)
    op = rng.randrange(6)
    if op == 0:
        t[1] = t[1] + [1] * rng.choice([1, 3, 5]) if rng.random() < 0.5 else t[1][:-1]
        what = f"dims -> {t[1]}"
    elif op == 1:
        d = rng.randrange(len(t[1])) if t[1] else 0
        if t[1]:
            t[1][d] = rng.choice(INTS)
        what = f"dims -> {t[1]}"
    elif op == 2:
        t[2] = rng.choice([0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 30, 31, 39, 40, 2**31])
        what = f"type -> {t[2]}"
    elif op == 3:
        t[3] = rng.choice(INTS + [t[3] + 1, t[3] + 32, t[3] - 32, len(data)]) % 2**64
        what = f"offset -> {t[3]}"
    elif op == 4:
        t[0] = rng.choice(["", "x" * 70, tensors[0][0], "blk.9.attn_q.weight", "blk.0.attn_q.bias", "../../etc"])
        what = f"name -> {t[0]!r}"
    else:
        rng.shuffle(tensors)
        what = "reordered"
    return serialize(version, kvs, tensors, data), f"tensor {t[0]!r}: {what}"


MUTATORS = [m_bitflip, m_bitflip, m_bytes, m_truncate, m_extend, m_header, m_metadata, m_metadata, m_metadata,
            m_tensor, m_tensor, m_tensor]


# --- the target ----------------------------------------------------------------------------------


def prepare(workdir):
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "base.gguf"
    write_base(path)
    raw = path.read_bytes()
    parts = parse(raw)
    header_end = len(raw) - len(parts[3])
    from vqpipe.stages.download import fetch

    fetch(f"gguf:{path}", workdir / "base-out")  # the unmutated file converts
    return {"bytes": raw, "parts": parts, "header_end": header_end, "work": workdir}


def run_case(ctx, seed, index):
    from vqpipe.stages.download import fetch

    rng = random.Random(f"gguf:{seed}:{index}")
    data, what = rng.choice(MUTATORS)(rng, ctx)
    path, out = ctx["work"] / "case.gguf", ctx["work"] / "case-out"
    path.write_bytes(data)
    try:
        fetch(f"gguf:{path}", out)
    except (ValueError, FileNotFoundError) as e:
        return "rejected", str(e)[-160:]
    except Exception as e:  # noqa: BLE001 - every other exception is a finding
        return "other", f"{what}: {type(e).__name__}: {e}"[:400]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return "converted", what
