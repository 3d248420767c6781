"""The reservoir: round trips (in process and in a fresh process), graft, corruption, atomic writes."""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from mlx.utils import tree_flatten

from vqpipe import prefault
from vqpipe.store import zerocopy
from vqpipe.store import reservoir as R
from vqpipe.quant.config import QuantizeConfig
from vqpipe.quant.quantize import quantize_model, quantized_layers

TOKENS = mx.array([[1, 5, 9, 2, 77, 31, 4, 100]], dtype=mx.int32)

# name -> (architecture config, rotation, quantize embeddings)
MODELS = {
    # 64 -> hadamard, 76 = 19 * 4 -> kron (auto).
    "auto": ({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 76, "num_attention_heads": 4,
              "num_key_value_heads": 2}, "auto", False),
    "kron": ({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 76, "num_attention_heads": 4,
              "num_key_value_heads": 2}, "kron", False),
    "qr": ({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 76, "num_attention_heads": 4,
            "num_key_value_heads": 2}, "qr", False),
    "none": ({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 76, "num_attention_heads": 4,
              "num_key_value_heads": 2}, "none", False),
    # A deliberately tiny width: in_features = 50 = 25 * 2 for q/k/v/gate/up.
    "in50": ({"model_type": "qwen2", "hidden_size": 50, "intermediate_size": 64, "num_attention_heads": 5,
              "num_key_value_heads": 1}, "auto", False),
    "in50-qr": ({"model_type": "qwen2", "hidden_size": 50, "intermediate_size": 64, "num_attention_heads": 5,
                 "num_key_value_heads": 1}, "qr", False),
    # Quantized (tied) embedding table, and a Llama with an untied, quantized lm_head.
    "embed": ({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2}, "auto", True),
    "llama": ({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "tie_word_embeddings": False}, "qr", False),
}
BASE = {"num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def make_model(arch, seed=0):
    from mlx_lm.utils import _get_classes

    config = {**BASE, **arch}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Non-trivial norms, so a swapped or dropped norm would show in the logits.
    model.update(model.parameters())
    norms = [(k, mx.random.uniform(0.5, 1.5, v.shape)) for k, v in tree_flatten(model.parameters()) if "norm" in k]
    model.load_weights(norms, strict=False)
    mx.eval(model.parameters())
    return model, config


def logits(model):
    out = model(TOKENS).astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def build(name, directory, persist):
    """Quantize MODELS[name], save it to ``directory`` (with config.json); (model, reservoir file)."""
    arch, rotation, embeddings = MODELS[name]
    model, config = make_model(arch)
    settings = QuantizeConfig(4 if name != "in50" else 3, rotation, 1, embeddings, dtype="float32", threads=1,
                              calib_text="none")
    quantize_model(model, settings)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    path = directory / R.FILE_NAME
    R.save_reservoir(model, path, persist_rotation=persist)
    return model, path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{(name, persist): (in-memory quantized model, reservoir path, its logits)} for every model."""
    root = tmp_path_factory.mktemp("reservoirs")
    out = {}
    for name in MODELS:
        for persist in (True, False):
            model, path = build(name, root / f"{name}-{'on' if persist else 'off'}", persist)
            out[(name, persist)] = (model, path, logits(model))
    return out


def same_params(a, b):
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape, k
        assert np.array(pa[k]).tobytes() == np.array(pb[k]).tobytes(), k


@pytest.mark.parametrize("persist", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_in_process(built, name, persist):
    model, path, want = built[(name, persist)]
    loaded = R.load_reservoir(path)
    same_params(model, loaded)
    for lname, layer in quantized_layers(model).items():
        other = quantized_layers(loaded)[lname]
        assert type(other) is type(layer)
        assert other.rotation.kind == layer.rotation.kind
        if layer.rotation.kind == "qr":
            assert np.array_equal(np.array(other.rotation.matrix), np.array(layer.rotation.matrix))
    assert logits(loaded).tobytes() == want.tobytes()


def test_fresh_process_logits_byte_identical(built, tmp_path):
    """One new interpreter loads every reservoir (both modes, every rotation kind, in_features=50)."""
    jobs = {f"{n}-{'on' if p else 'off'}": str(path) for (n, p), (_, path, _) in built.items()}
    script = textwrap.dedent("""
        import json, sys
        import mlx.core as mx, numpy as np
        from vqpipe.store.reservoir import load_reservoir
        jobs, out = json.loads(sys.argv[1]), sys.argv[2]
        tokens = mx.array(json.loads(sys.argv[3]), dtype=mx.int32)
        for key, path in jobs.items():
            y = load_reservoir(path)(tokens).astype(mx.float32)
            mx.eval(y)
            np.save(f"{out}/{key}.npy", np.array(y))
    """)
    subprocess.run([sys.executable, "-c", script, json.dumps(jobs), str(tmp_path), json.dumps(TOKENS.tolist())],
                   check=True, timeout=600)
    for (name, persist), (_, _, want) in built.items():
        got = np.load(tmp_path / f"{name}-{'on' if persist else 'off'}.npy")
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), (name, persist)


def test_layer_classes_and_rotation_kinds_covered(built):
    kinds, classes, widths = set(), set(), set()
    for (_, _), (_, path, _) in built.items():
        for meta in R.read_header(path)["layers"].values():
            kinds.add(meta["rotation"]["kind"])
            classes.add(meta["class"])
            widths.add(meta["in_features"])
    assert kinds == {"hadamard", "kron", "qr", "none"}
    assert classes == {"QuantizedLinear", "QuantizedEmbedding"}
    assert 50 in widths


def test_persist_modes(built):
    for name in MODELS:
        on, off = R.read_header(built[(name, True)][1]), R.read_header(built[(name, False)][1])
        has_qr = any(m["rotation"]["kind"] == "qr" for m in on["layers"].values())
        assert on["persist_rotation"] is True and off["persist_rotation"] is False
        for lname, m in off["layers"].items():
            rot = m["rotation"]
            if rot["kind"] == "qr":
                assert rot["regenerate"] and "rotation.matrix" not in m["tensors"]
                assert "rotation.matrix" in on["layers"][lname]["tensors"]
            else:
                assert not rot.get("regenerate")
                assert m["tensors"].keys() == on["layers"][lname]["tensors"].keys()
        if has_qr:
            assert off["_file_size"] < on["_file_size"]
        else:  # structured rotations are always stored: the two files are the same size
            assert off["_file_size"] == on["_file_size"]


def test_layout_alignment_and_dedup(built):
    header = R.read_header(built[("auto", True)][1])
    assert header["_data_offset"] % R.ALIGN == 0
    for b in header["blobs"]:
        assert b["offset"] % (R.ALIGN if b["nbytes"] >= R.ALIGN else R.SMALL_ALIGN) == 0
    # Every 4-bit layer of one width and code kind shares one codebook blob (trellis layers: the table).
    books = {((m.get("codes") or {}).get("kind", "scalar"), m["in_features"], m["tensors"]["codebook"]["blob"])
             for m in header["layers"].values()}
    assert len(books) == len({(k, w) for k, w, _ in books})
    assert all(b["kind"] in R.BLOB_KINDS for b in header["blobs"])


def test_deterministic_bytes(tmp_path):
    a = build("auto", tmp_path / "a", False)[1].read_bytes()
    b = build("auto", tmp_path / "b", False)[1].read_bytes()
    assert a == b


def test_load_from_embedded_config(built, tmp_path):
    """The file alone is enough: no config.json next to it."""
    model, path, want = built[("kron", True)]
    lone = tmp_path / "elsewhere.vqres"
    lone.write_bytes(path.read_bytes())
    assert logits(R.load_reservoir(lone)).tobytes() == want.tobytes()


def test_lazy_skeleton_never_evaluated(built):
    """The skeleton's random init is replaced before it is ever computed: peak ~ the stored tensors."""
    _, path, _ = built[("auto", True)]
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    model = R.load_reservoir(path)
    stored = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    # The init would add another fp32 copy of every dense weight (~2x); allow copies of small tensors.
    assert mx.get_peak_memory() - before < 1.3 * stored


def test_graft_into_unquantized_model(built):
    model, path, want = built[("auto", False)]
    fresh, _ = make_model(MODELS["auto"][0])
    # quantize_model casts non-quantized params to float32; the fresh model is float32 already.
    R.graft_reservoir(fresh, path)
    assert logits(fresh).tobytes() == want.tobytes()


def test_graft_into_lazy_skeleton(built):
    from vqpipe.quant.quantize import skeleton

    model, path, _ = built[("qr", False)]
    skel = skeleton(path.parent)
    R.graft_reservoir(skel, path)
    layers = quantized_layers(skel)
    assert set(layers) == set(quantized_layers(model))
    for name, layer in layers.items():
        assert np.array_equal(np.array(layer.packed), np.array(quantized_layers(model)[name].packed))


def test_graft_shape_mismatch(built):
    _, path, _ = built[("auto", True)]
    other, _ = make_model(MODELS["in50"][0])
    with pytest.raises(R.ReservoirError, match="in the reservoir but"):
        R.graft_reservoir(other, path)


def test_config_mismatch_is_reported(built, tmp_path):
    _, path, _ = built[("auto", True)]
    d = tmp_path / "wrong"
    d.mkdir()
    (d / R.FILE_NAME).write_bytes(path.read_bytes())
    (d / "config.json").write_text(json.dumps({**BASE, **MODELS["in50"][0]}))
    with pytest.raises(R.ReservoirError, match="in the reservoir but"):
        R.load_reservoir(d)


def test_save_requires_quantized_model():
    model, _ = make_model(MODELS["auto"][0])
    with pytest.raises(ValueError, match="quantize it first"):
        R.save_reservoir(model, "/nonexistent/x.vqres")


# --- corruption ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(built):
    """A reservoir with every blob kind (packed, scales, codebook, rotation, bias, param)."""
    return built[("auto", True)][1]


def variant(tmp_path, src, name, edit):
    data = bytearray(src.read_bytes())
    out = edit(data)
    data = data if out is None else out
    p = tmp_path / name
    p.write_bytes(bytes(data))
    return p


def reprefix(data, **fields):
    """Rewrite prefix fields and recompute the prefix checksum (a consistent but wrong prefix)."""
    names = ("magic", "version", "flags", "header_len", "header_hash", "data_offset", "file_size", "prefix_hash")
    values = dict(zip(names, struct.unpack_from("<8sIIQQQQQ", data)))
    values.update(fields)
    head = struct.pack("<8sIIQQQQ", *[values[n] for n in names[:7]])
    data[:56] = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return data


def rewrite_header(data, mutate):
    """Apply ``mutate`` to the JSON header and re-serialize it with valid checksums, blobs in place."""
    _, _, _, hlen, _, data_offset, size, _ = struct.unpack_from("<8sIIQQQQQ", data)
    header = json.loads(bytes(data[64:64 + hlen]))
    mutate(header)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert 64 + len(text) <= data_offset
    data[64:data_offset] = text + bytes(data_offset - 64 - len(text))
    return reprefix(data, header_len=len(text), header_hash=xxhash.xxh3_64_intdigest(text))


def expect_error(path, pattern):
    with pytest.raises(R.ReservoirError, match=pattern):
        R.load_reservoir(path)


def test_good_file_loads(good):
    assert R.load_reservoir(good) is not None
    assert all(ok for _, ok in R.verify_blobs(good))


@pytest.mark.parametrize("cut", ["empty", 10, 63, 64, "mid-header", "data-start", "mid-blob", "minus-1"])
def test_truncation(good, tmp_path, cut):
    header = R.read_header(good)
    size = header["_file_size"]
    big = max(header["blobs"], key=lambda b: b["nbytes"])
    at = {"empty": 0, "mid-header": 64 + 100, "data-start": header["_data_offset"],
          "mid-blob": header["_data_offset"] + big["offset"] + big["nbytes"] // 2, "minus-1": size - 1}.get(cut, cut)
    p = variant(tmp_path, good, "cut.vqres", lambda d: d[:at])
    expect_error(p, "shorter than|truncated")


def test_trailing_bytes(good, tmp_path):
    expect_error(variant(tmp_path, good, "long.vqres", lambda d: d + b"\0"), "trailing bytes")


def test_every_prefix_byte_flip_is_caught(good, tmp_path):
    for i in range(R.PREFIX_SIZE):
        def flip(d, i=i):
            d[i] ^= 0x10
        expect_error(variant(tmp_path, good, "flip.vqres", flip), ".")


def test_header_flip(good, tmp_path):
    hlen = struct.unpack_from("<Q", good.read_bytes(), 16)[0]
    for at in (64, 64 + hlen // 2, 64 + hlen - 1):
        def flip(d, at=at):
            d[at] ^= 0x01
        expect_error(variant(tmp_path, good, "hflip.vqres", flip), "header checksum mismatch")


@pytest.mark.parametrize("kind", R.BLOB_KINDS)
def test_blob_flip_each_kind(good, tmp_path, kind):
    header = R.read_header(good)
    blob = next(b for b in header["blobs"] if b["kind"] == kind)
    for at in (0, blob["nbytes"] // 2, blob["nbytes"] - 1):
        def flip(d, at=at):
            d[header["_data_offset"] + blob["offset"] + at] ^= 0x80
        p = variant(tmp_path, good, "bflip.vqres", flip)
        expect_error(p, rf"checksum mismatch in blob \d+ \({kind},")
        assert not all(ok for _, ok in R.verify_blobs(p))


def test_wrong_magic_and_foreign_files(good, tmp_path):
    def magic(d):
        d[:8] = b"PK\x03\x04\0\0\0\0"
    expect_error(variant(tmp_path, good, "magic.vqres", magic), "not a vqpipe reservoir")
    st = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(st), {"a": mx.zeros((4,))})
    expect_error(st, "not a vqpipe reservoir")
    junk = tmp_path / "junk.vqres"
    junk.write_bytes(os.urandom(100_000))
    expect_error(junk, "not a vqpipe reservoir")
    expect_error(tmp_path / "missing.vqres", "cannot open")


def test_wrong_version(good, tmp_path):
    newer = max(R.READS) + 1
    expect_error(variant(tmp_path, good, "vnext.vqres", lambda d: reprefix(d, version=newer)),
                 f"unsupported reservoir format version {newer}")
    # A flipped version field without a matching prefix checksum is caught too.
    def raw_version(d):
        d[8:12] = struct.pack("<I", 99)
    expect_error(variant(tmp_path, good, "v99.vqres", raw_version), "version 99")


@pytest.mark.parametrize("value", [2**62, 2**64 - 1, R.MAX_HEADER + 1, 10**9])
def test_absurd_header_length(good, tmp_path, value):
    expect_error(variant(tmp_path, good, "hl.vqres", lambda d: reprefix(d, header_len=value)),
                 "header length .* out of bounds")
    def raw(d):
        d[16:24] = struct.pack("<Q", value)
    expect_error(variant(tmp_path, good, "hl2.vqres", raw), "prefix checksum mismatch")


def test_bad_data_offset(good, tmp_path):
    size = len(good.read_bytes())
    for off in (0, 100, size + R.ALIGN):
        expect_error(variant(tmp_path, good, "do.vqres", lambda d, off=off: reprefix(d, data_offset=off)),
                     "data offset")


def first_layer(h):
    return next(iter(h["layers"].values()))


@pytest.mark.parametrize("mutate,pattern", [
    (lambda h: h["blobs"][0].update(offset=10**12), "runs past the end"),
    (lambda h: h["blobs"][0].update(nbytes=h["blobs"][0]["nbytes"] + 4), "needs .* bytes"),
    (lambda h: h["blobs"][0].update(offset=-1), "blob 0 entry is invalid"),
    (lambda h: h["blobs"][0].update(kind="pickle"), "blob 0 entry is invalid"),
    (lambda h: first_layer(h).update(bits=7), "invalid bits"),
    (lambda h: first_layer(h).update(bits=2), "tensor 'packed'"),
    (lambda h: first_layer(h).update(out_features=7), "tensor 'packed'"),
    (lambda h: first_layer(h)["rotation"].update(kind="eval"), "unknown rotation kind"),
    (lambda h: first_layer(h)["rotation"].update(dim=3), "rotation dim"),
    (lambda h: first_layer(h)["tensors"].pop("scales"), "has tensors"),
    (lambda h: first_layer(h)["tensors"]["packed"].update(dtype="object"), "unknown dtype"),
    (lambda h: first_layer(h)["tensors"]["packed"].update(blob=10**6), "no valid blob index"),
    (lambda h: first_layer(h).update({"class": "os.system"}), "no known class"),
    (lambda h: h.update(format_version=max(R.READS) + 1), "unsupported header"),
    (lambda h: h.update(format_version=2), "format_version 2 but the prefix says 5"),  # trellis layers: v5
    (lambda h: first_layer(h).update(group_size=7), "group_size 7 does not divide"),
    (lambda h: first_layer(h).update(group_size=4), "tensor 'scales'"),
    (lambda h: h.update(persist_rotation="yes"), "persist_rotation"),
    (lambda h: h.update(layers=[]), "no layers/params"),
    (lambda h: h["params"].pop(next(iter(h["params"]))), "missing"),
    (lambda h: h["params"][next(iter(h["params"]))].update(shape=[1]), "needs .* bytes|in the model"),
])
def test_inconsistent_header(good, tmp_path, mutate, pattern):
    expect_error(variant(tmp_path, good, "hdr.vqres", lambda d: rewrite_header(d, mutate)), pattern)


def test_unparseable_header(good, tmp_path):
    def garbage(d):
        _, _, _, hlen, _, data_offset, _, _ = struct.unpack_from("<8sIIQQQQQ", d)
        text = b'{"format": "vqpipe-reservoir", nan'
        d[64:64 + len(text)] = text
        return reprefix(d, header_len=len(text), header_hash=xxhash.xxh3_64_intdigest(text))
    expect_error(variant(tmp_path, good, "json.vqres", garbage), "malformed header")


def test_regenerated_qr_mismatch_is_reported(built, tmp_path):
    """A different LAPACK (simulated by a wrong stored checksum) must not give wrong weights."""
    _, path, _ = built[("qr", False)]

    def wrong(h):
        first_layer(h)["rotation"]["matrix_xxh3_64"] = "0123456789abcdef"
    p = variant(tmp_path, path, "qr.vqres", lambda d: rewrite_header(d, wrong))
    expect_error(p, "regenerated from seed .* differs .*LAPACK")


# --- atomic writes ---------------------------------------------------------------------------


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    import test_reservoir as T
    from vqpipe.store import reservoir as R
    point, target = sys.argv[1], sys.argv[2]
    model, _ = T.make_model(T.MODELS["qr"][0], seed=5)
    T.quantize_model(model, T.QuantizeConfig(4, "qr", 9, dtype="float32", threads=1, calib_text="none"))
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if point == "mid-blobs":
        calls = [0]
        def counting(x):
            calls[0] += 1
            if calls[0] == 3:
                die()
            return memoryview(x)
        R.memoryview = counting
    elif point == "before-prefix":
        R.os.fsync = die
    elif point == "before-rename":
        R.os.replace = die
    R.save_reservoir(model, target, persist_rotation=True)
""")


@pytest.mark.parametrize("point", ["mid-blobs", "before-prefix", "before-rename"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_killed_writer_leaves_nothing_loadable(built, tmp_path, point, existing):
    target = tmp_path / R.FILE_NAME
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **MODELS["qr"][0]}))
    old_model, old_path, old_logits = built[("qr", True)]
    if existing:
        target.write_bytes(old_path.read_bytes())
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, point, str(target), os.path.dirname(__file__)],
                          capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    if existing:  # the old reservoir is untouched and still loads, with its own weights
        assert logits(R.load_reservoir(target)).tobytes() == old_logits.tobytes()
    else:
        assert not target.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers, "the killed writer's temporary file should be there to inspect"
    for p in leftovers:
        if point == "before-rename":
            # Complete and fsynced, only never renamed: it is an intact reservoir of the new model.
            assert all(ok for _, ok in R.verify_blobs(p))
        else:
            with pytest.raises(R.ReservoirError, match="partially written|not a vqpipe reservoir"):
                R.load_reservoir(p)


def test_layer_class_must_match_module(good, tmp_path):
    def as_embedding(h):
        first_layer(h)["class"] = "QuantizedEmbedding"
    expect_error(variant(tmp_path, good, "cls.vqres", lambda d: rewrite_header(d, as_embedding)),
                 "QuantizedEmbedding in the reservoir but a Linear")


def test_deeply_nested_header(good, tmp_path):
    def nested(d):
        text = b"[" * 200_000 + b"]" * 200_000
        hlen, data_offset = 64 + len(text), -(-(64 + len(text)) // R.ALIGN) * R.ALIGN
        return reprefix(bytearray(d[:64]) + text + bytes(data_offset - hlen), header_len=len(text),
                        header_hash=xxhash.xxh3_64_intdigest(text), data_offset=data_offset, file_size=data_offset)
    expect_error(variant(tmp_path, good, "deep.vqres", nested), "malformed header")


def test_stale_temp_of_killed_writer_is_removed(built, tmp_path):
    """A SIGKILLed writer's temporary is removed by the next write; a live writer's, another host's
    and an old-style (pid-less) temporary are left alone."""
    from vqpipe.store import fsutil

    target = tmp_path / R.FILE_NAME
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **MODELS["qr"][0]}))
    writer = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, "before-rename", str(target),
                               os.path.dirname(__file__)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = writer.communicate(timeout=300)
    assert writer.returncode == -signal.SIGKILL, err.decode()[-2000:]
    stale = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert [p.name.split(".")[4] for p in stale] == [str(writer.pid)], stale  # .model.vqres.HOST.PID.x.tmp
    host = fsutil._host_tag()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f".{target.name}.{host}.{sleeper.pid}.abc123.tmp"
        other_host = tmp_path / f".{target.name}.not-{host}-x.{writer.pid}.abc123.tmp"
        legacy = tmp_path / f".{target.name}.k3j4h5_q.tmp"
        for p in (live, other_host, legacy):
            p.write_bytes(b"partial")
        model, _, want = built[("qr", True)]
        R.save_reservoir(model, target, persist_rotation=True)
        assert logits(R.load_reservoir(target)).tobytes() == want.tobytes()
        assert not any(p.exists() for p in stale)
        assert live.exists() and other_host.exists() and legacy.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    R.save_reservoir(model, target, persist_rotation=True)  # its writer is gone now: removed too
    assert not live.exists() and other_host.exists() and legacy.exists()


def test_stale_temp_dir_of_dead_writer_is_removed(tmp_path):
    from vqpipe.store import fsutil

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / f".out.{fsutil._host_tag()}.{int(dead.stdout)}.xyz.tmp"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "f").write_text("partial")
    with fsutil.atomic_dir(tmp_path / "out") as d:
        (d / "f").write_text("done")
    assert not stale.exists() and (tmp_path / "out" / "f").read_text() == "done"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# --- truncation while loading, prefaulting, zero-copy fallback -------------------------------


TRUNCATE_SCRIPT = textwrap.dedent("""
    import os, sys
    from vqpipe import prefault as P
    from vqpipe.store import reservoir as R
    path, where, prefault = sys.argv[1], sys.argv[2], sys.argv[3] == "prefault"
    if prefault:
        P.PREFAULT_MIN = 0
    header = R.read_header(path)
    big = max(header["blobs"], key=lambda b: b["nbytes"])
    at = {"data-start": header["_data_offset"], "zero": 0,
          "mid-blob": header["_data_offset"] + big["offset"] + big["nbytes"] // 2}[where]
    build_layers = R._build_layers
    def truncate_then_build(*a, **k):  # after the size check, with the file open for reading
        os.truncate(path, at)
        return build_layers(*a, **k)
    R._build_layers = truncate_then_build
    try:
        R.load_reservoir(path)
    except R.ReservoirError as e:
        print("ReservoirError:", e)
        sys.exit(0)
    print("loaded a truncated file")
    sys.exit(3)
""")


@pytest.mark.parametrize("prefault", ["prefault", "plain"])
@pytest.mark.parametrize("where", ["mid-blob", "data-start", "zero"])
def test_truncated_while_loading(good, tmp_path, where, prefault):
    """Truncating the file after its size was checked gives ReservoirError, never SIGBUS (the load
    runs in a child process, so a crash would fail this test instead of killing pytest)."""
    p = tmp_path / R.FILE_NAME
    p.write_bytes(good.read_bytes())
    (tmp_path / "config.json").write_bytes((good.parent / "config.json").read_bytes())
    proc = subprocess.run([sys.executable, "-c", TRUNCATE_SCRIPT, str(p), where, prefault],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "truncated while being loaded" in proc.stdout


def test_verify_blobs_truncated_while_reading(good, tmp_path):
    p = variant(tmp_path, good, "cut.vqres", lambda d: None)
    header = R.read_header(p)
    os.truncate(p, header["_data_offset"] + 100)
    with pytest.raises(R.ReservoirError, match="truncated"):
        R.verify_blobs(p, header)


@pytest.mark.skipif(not prefault.prefault_policy()[0], reason="prefaulting needs Linux + glibc + the CPU backend")
def test_prefault_path_is_bit_exact_and_restores_malloc(built, monkeypatch):
    import ctypes
    import threading

    monkeypatch.setattr(prefault, "PREFAULT_MIN", 0)
    ranges = []
    enter = prefault.Prefault.__enter__

    def recording_enter(self):
        out = enter(self)
        ranges.append(self.range)
        return out
    monkeypatch.setattr(prefault.Prefault, "__enter__", recording_enter)
    for name in ("embed", "llama"):
        model, path, want = built[(name, True)]
        loaded = R.load_reservoir(path)
        same_params(model, loaded)
        assert logits(loaded).tobytes() == want.tobytes()
    assert len(ranges) == 2 and all(ranges), "the prefault path did not run"
    assert not any(t.name == "vqpipe-prefault" for t in threading.enumerate())
    assert prefault._prefault_lock.acquire(blocking=False)
    prefault._prefault_lock.release()
    # M_MMAP_MAX is back to glibc's default: a big buffer is mmapped again, not carved from the heap.
    # 4 GiB (address space only, never touched): a smaller one can be served from free heap chunks
    # an earlier test's prefaulted load left behind, whatever M_MMAP_MAX says.
    libc = ctypes.CDLL(None)
    libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
    big = np.empty(4 << 30, np.uint8)
    assert big.ctypes.data > libc.sbrk(0)


def test_prefault_policy_env(monkeypatch):
    monkeypatch.setenv("VQPIPE_PREFAULT", "0")
    assert prefault.prefault_policy() == (False, "VQPIPE_PREFAULT=0")
    monkeypatch.delenv("VQPIPE_PREFAULT")
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "10")
    assert prefault.prefault_policy()[0] is False


def test_zero_copy_opt_in_falls_back(built, monkeypatch):
    """zerocopy.enable() (Metal only) makes loads try mx.asarray(copy=False) on the mapped file; where MLX refuses
    (the CPU backend always does) the blob is read as usual. The adoption itself is untested here."""
    model, path, want = built[("auto", True)]
    monkeypatch.setattr(zerocopy, "wanted", lambda: True)
    tried = []
    adopt = zerocopy.adopt
    monkeypatch.setattr(zerocopy, "adopt", lambda *a: tried.append(a[2]) or adopt(*a))
    loaded = R.load_reservoir(path)
    assert tried and min(tried) >= R.ALIGN
    same_params(model, loaded)
    assert logits(loaded).tobytes() == want.tobytes()


def test_atomic_writes_get_the_umask_mode_not_mkstemps(tmp_path):
    # mkstemp/mkdtemp create 0600/0700: published artifacts must be readable like any open()ed file.
    from vqpipe.store import fsutil

    old = os.umask(0o022)
    try:
        fsutil.write_json(tmp_path / "a.json", {"x": 1})
        with fsutil.atomic_dir(tmp_path / "d") as d:
            (d / "f").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755
