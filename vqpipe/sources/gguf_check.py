"""Structural validation of a GGUF file in pure Python, before any native parser sees it.

MLX's GGUF reader (``mx.load``, C code) trusts the file: a count, length or offset that a damaged
or hostile file gets wrong can make it read out of bounds or allocate without limit. ``check``
walks the whole header (GGUF v2/v3: header, key/value metadata, tensor infos) with every length
checked against the bytes that remain before it is used, so the work and memory are linear in the
file size, and it checks every tensor: a known type, 1-4 dimensions, a row length that is a whole
number of blocks, an aligned offset, data inside the file and no two tensors overlapping.
Only then may ``gguf.GGUFReader`` and ``mx.load`` open the file (vqpipe/sources/gguf.py).
"""

import struct
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME, including the terminating NUL of llama.cpp's copy
MAX_ARRAY_DEPTH = 2
DEFAULT_ALIGNMENT = 32
# value type -> struct format of a scalar (8 string, 9 array are read separately)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class _Reader:
    def __init__(self, f, size, path):
        self.f, self.size, self.path, self.pos = f, size, path, 0

    def fail(self, msg):
        raise ValueError(f"{self.path}: malformed GGUF at byte {self.pos}: {msg}")

    def read(self, n, what):
        if n > self.size - self.pos:
            self.fail(f"{what} needs {n} bytes, only {self.size - self.pos} remain (truncated or corrupt)")
        data = self.f.read(n)
        if len(data) != n:
            self.fail(f"short read of {what}")
        self.pos += n
        return data

    def unpack(self, fmt, what):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))[0]

    def string(self, what, limit=None):
        n = self.unpack("<Q", f"the length of {what}")
        if limit is not None and n > limit:
            self.fail(f"{what} is {n} bytes long (limit {limit})")
        raw = self.read(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def value(self, vtype, what, depth=0):
        if vtype in SCALARS:
            v = self.unpack(SCALARS[vtype], what)
            if vtype == 7 and v not in (0, 1):
                self.fail(f"{what} is a bool of value {v}")
            return v
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            self.fail(f"{what} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        etype = self.unpack("<I", f"the element type of {what}")
        if etype not in SCALARS and etype not in (STRING, ARRAY):
            self.fail(f"{what} has unknown element type {etype}")
        n = self.unpack("<Q", f"the length of {what}")
        least = struct.calcsize(SCALARS[etype]) if etype in SCALARS else 8 if etype in (STRING, ARRAY) else 1
        if n * least > self.size - self.pos:
            self.fail(f"{what} claims {n} elements, more than the remaining bytes can hold")
        if etype in SCALARS:  # read in one piece: a 150k-entry token type table is common
            fmt = SCALARS[etype]
            self.read(n * struct.calcsize(fmt), what)
            return n
        for i in range(n):
            self.value(etype, f"{what}[{i}]", depth + 1)
        return n


def _type_sizes():
    """{GGML type id: (block size, bytes per block)} from the gguf package's tables."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}


def check(path):
    """Validate the structure of the GGUF file ``path``; returns a summary dict.

    Raises ValueError naming the file, the byte offset and what is wrong.
    """
    path = Path(path)
    size = path.stat().st_size
    sizes = _type_sizes()
    with open(path, "rb") as f:
        r = _Reader(f, size, path)
        if r.read(4, "the magic") != MAGIC:
            r.fail("not a GGUF file (no GGUF magic)")
        version = r.unpack("<I", "the version")
        if version not in VERSIONS:
            r.fail(f"unsupported GGUF version {version} (supported: {VERSIONS})")
        n_tensors = r.unpack("<Q", "the tensor count")
        n_kv = r.unpack("<Q", "the metadata count")
        # Each metadata entry takes >= 12 bytes and each tensor info >= 24: bound the loops.
        if n_kv * 12 + n_tensors * 24 > size:
            r.fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in {size} bytes")
        keys, alignment = set(), DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = r.string(f"metadata key {i}", limit=65535)
            if key in keys:
                r.fail(f"metadata key {key!r} appears twice")
            keys.add(key)
            vtype = r.unpack("<I", f"the type of {key!r}")
            v = r.value(vtype, f"metadata {key!r}")
            if key == "general.alignment":
                if vtype != 4 or v == 0 or v & (v - 1):
                    r.fail(f"general.alignment must be a power-of-two uint32, got {v!r} (type {vtype})")
                alignment = v
        tensors = []
        for i in range(n_tensors):
            name = r.string(f"tensor name {i}", limit=MAX_NAME - 1)
            n_dims = r.unpack("<I", f"the dimension count of {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                r.fail(f"tensor {name!r} has {n_dims} dimensions (1-{MAX_DIMS})")
            dims = [r.unpack("<Q", f"dimension {d} of {name!r}") for d in range(n_dims)]
            ttype = r.unpack("<I", f"the type of {name!r}")
            offset = r.unpack("<Q", f"the offset of {name!r}")
            tensors.append((name, dims, ttype, offset))
        data_start = -(-r.pos // alignment) * alignment
    names, spans = set(), []
    for name, dims, ttype, offset in tensors:
        where = f"{path}: tensor {name!r}"
        if name in names:
            raise ValueError(f"{where} appears twice")
        names.add(name)
        if ttype not in sizes:
            raise ValueError(f"{where} has unknown type {ttype}")
        block, block_bytes = sizes[ttype]
        if any(d < 1 or d >= 2**31 for d in dims):
            raise ValueError(f"{where} has a dimension out of range: {dims}")
        if dims[0] % block:
            raise ValueError(f"{where}: rows of {dims[0]} are not whole blocks of {block}")
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * block_bytes
        if offset % alignment:
            raise ValueError(f"{where}: offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > size:
            raise ValueError(f"{where}: {nbytes} bytes at {start} run past the end of the {size}-byte file (truncated or corrupt)")
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{path}: tensors {a!r} and {b!r} overlap")
    return {"version": version, "tensors": len(tensors), "metadata": n_kv, "alignment": alignment,
            "data_start": data_start}


# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def field(reader, key, default=KeyError):
    """Metadata ``key`` of a gguf-py reader (ValueError naming it when missing and no ``default``)."""
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()
