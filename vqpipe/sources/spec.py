"""A model source (``scheme:value``, docs/models.md) and what a model directory needs."""

from pathlib import Path


SCHEMES = ("synth", "hf", "path", "gguf")


def parse_source(source):
    """``'synth:tiny'`` -> ``('synth', 'tiny')``; raises ValueError on a bad scheme or empty value."""
    scheme, sep, value = str(source).partition(":")
    if not sep or scheme not in SCHEMES or not value:
        forms = "synth:PRESET[-4bit], hf:REPO[@REVISION], path:DIR, gguf:FILE, gguf:pkg:PACKAGE/PATH"
        raise ValueError(f"bad model source {source!r}; expected one of: {forms}")
    return scheme, value


def check_model_dir(path):
    """A model directory needs config.json and at least one *.safetensors file."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} is missing; is {path} a model directory?")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weight files in {path}")
