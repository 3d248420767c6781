"""Sources are untrusted: path:/hf: never bring code or pickles along, and cannot make the copy
read outside the source or write outside the output directory."""

import json
import os
import re
from pathlib import Path

import pytest

from vqpipe.stages import download
from vqpipe.stages.download import HF_ALLOW_PATTERNS, fetch

ROOT = Path(download.__file__).resolve().parents[1]
UNSAFE = ["modeling_evil.py", "pytorch_model.bin", "weights.pt", "state.pth", "x.pkl", "native.so", "Upper.PY"]


@pytest.fixture
def hostile_source(tiny_source, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for p in tiny_source.iterdir():
        if p.name not in ("vqpipe-source.json", "manifest.json"):
            (src / p.name).write_bytes(p.read_bytes())
    for name in UNSAFE:
        (src / name).write_text("import os; os.system('touch /tmp/pwned')\n")
    (src / "sub").mkdir()
    (src / "sub" / "helper.py").write_text("raise SystemExit\n")
    (src / "sub" / "notes.txt").write_text("kept\n")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_path_source_copies_no_code_or_pickles(hostile_source, tmp_path):
    out = fetch(f"path:{hostile_source}", tmp_path / "out")
    names = {str(p.relative_to(out)) for p in out.rglob("*")}
    assert not [n for n in names if n.lower().endswith(download.UNSAFE_SUFFIXES)], names
    assert "sub/notes.txt" in names and "model.safetensors" in names


def test_link_out_of_the_source_is_refused(hostile_source, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for you")
    os.symlink(secret, hostile_source / "tokenizer_extra.txt")
    with pytest.raises(ValueError, match="outside the source"):
        fetch(f"path:{hostile_source}", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left


def test_links_inside_an_hf_snapshot_are_followed(tiny_source, tmp_path):
    """HF cache layout: snapshot files are links into the repository's blob store."""
    repo = tmp_path / "models--acme--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    for p in tiny_source.iterdir():
        if p.name not in ("vqpipe-source.json", "manifest.json"):
            (repo / "blobs" / p.name).write_bytes(p.read_bytes())
            os.symlink(Path("../../blobs") / p.name, snap / p.name)
    out = tmp_path / "out"
    out.mkdir()
    download.copy_model_dir(snap, out, root=snap.resolve().parents[1])
    assert (out / "model.safetensors").read_bytes() == (tiny_source / "model.safetensors").read_bytes()
    (tmp_path / "out2").mkdir()
    with pytest.raises(ValueError, match="outside the source"):  # the same links, root = the snapshot
        download.copy_model_dir(snap, tmp_path / "out2")


def test_hf_fetches_no_code():
    assert not [p for p in HF_ALLOW_PATTERNS if p.endswith((".py", ".bin", ".pt", ".pth", ".pkl"))]


def test_nothing_enables_remote_code():
    """No vqpipe module passes trust_remote_code=True (mlx-lm and transformers default to False)."""
    hits = [f"{p.relative_to(ROOT)}" for p in (ROOT / "vqpipe").rglob("*.py")
            if re.search(r"trust_remote_code\s*=\s*True", p.read_text())]
    assert hits == []


def test_quantize_refuses_a_custom_model_file(hostile_source, tmp_path):
    """A config asking for custom model code (model_file) is refused by the loader, not run."""
    from vqpipe.stages import quantize

    config = json.loads((hostile_source / "config.json").read_text())
    config["model_file"] = "modeling_evil.py"
    (hostile_source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code|custom"):
        quantize.run(hostile_source, tmp_path / "q", bits=4, progress=lambda *_: None)
    assert not Path("/tmp/pwned").exists()
