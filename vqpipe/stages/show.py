"""``vqpipe inspect FILE``: a human summary of a reservoir, with its checksums verified.

Exit status: 0 when the file is valid and every blob checksum matches, 1 otherwise.
"""

import argparse
import json
import sys
from collections import Counter

from ..store.reservoir import CHECKSUM, ReservoirError, _file, read_header, sizes, verify_blobs


def _mib(n):
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _counts(counter):
    return ", ".join(f"{k} x{v}" for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def _rotation_mode(rot):
    if rot["kind"] == "none":
        return "none"
    return f"{rot['kind']} (seed only)" if rot.get("regenerate") else f"{rot['kind']} (stored)"


def _codes(meta):
    """A layer's code kind: "scalar" (the Lloyd-Max codebook) or "trellis" (its entry's kind)."""
    return (meta.get("codes") or {}).get("kind", "scalar")


def blob_users(header):
    """{blob index: ["layer.key" or "param name", ...]}."""
    users = {}
    for name, meta in header["layers"].items():
        for key, spec in meta["tensors"].items():
            users.setdefault(spec["blob"], []).append(f"{name}.{key}")
    for name, spec in header["params"].items():
        users.setdefault(spec["blob"], []).append(name)
    return users


def summary(path, verify=True):
    header = read_header(path)
    layers = header["layers"]
    out = {
        "path": str(path),
        "format_version": header["format_version"],
        "vqpipe_version": header.get("vqpipe_version"),
        "persist_rotation": header["persist_rotation"],
        "model_type": (header.get("config") or {}).get("model_type"),
        "n_layers": len(layers),
        "classes": dict(Counter(m["class"] for m in layers.values())),
        "bits": {str(k): v for k, v in Counter(m["bits"] for m in layers.values()).items()},
        "rotations": dict(Counter(_rotation_mode(m["rotation"]) for m in layers.values())),
        "codes": dict(Counter(_codes(m) for m in layers.values())),
        "residual_rotation": header.get("residual_rotation"),
        "n_params": len(header["params"]),
        **sizes(header),
    }
    if verify:
        bad = [i for i, ok in verify_blobs(path, header) if not ok]
        users = blob_users(header)
        out["checksums"] = {
            "verified": len(header["blobs"]),
            "failed": [{"blob": i, "kind": header["blobs"][i]["kind"], "tensors": users.get(i, [])} for i in bad],
        }
    return header, out


def render(header, s, show_layers=False):
    cfg = header.get("config") or {}
    lines = [
        f"reservoir   {s['path']}",
        f"format      vqpipe-reservoir v{s['format_version']}, written by vqpipe {s['vqpipe_version']}, "
        f"checksums {CHECKSUM}",
        f"model       {s['model_type'] or 'unknown'}"
        + (f" (hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} blocks, vocab {cfg.get('vocab_size')})"
           if cfg else " (no config embedded)"),
        f"size        {_mib(s['file_bytes'])} ({s['file_bytes']:,} bytes): header {_mib(s['header_bytes'])}, "
        f"{s['n_blobs']} blobs for {s['n_tensors']} tensors",
        "persist_rotation  " + ("on: every rotation is stored as used, dense QR matrices included"
                                if s["persist_rotation"] else
                                "off: dense QR rotations are stored as seed + checksum and regenerated at load; "
                                "structured rotations are stored"),
        f"layers      {s['n_layers']} quantized ({_counts(Counter(s['classes']))}), "
        f"{s['n_params']} unquantized tensors",
        f"bits        {_counts(Counter({int(k): v for k, v in s['bits'].items()}))}",
        f"rotations   {_counts(Counter(s['rotations']))}",
        f"codes       {_counts(Counter(s['codes']))}",
        "residual    " + ("none" if not s["residual_rotation"] else
                          "{kind} rotation of the {dim}-wide stream, seed {seed}, folded into the weights".format(**s["residual_rotation"])),
        "bytes       " + ", ".join(f"{k} {_mib(v)}" for k, v in s["blob_bytes"].items() if v),
        f"ideal       {_mib(s['ideal_payload_bytes'])} (bits x weights / 8 + norms + unquantized tensors); "
        f"file / ideal = {s['file_over_ideal']:.3f}",
    ]
    if "checksums" in s:
        c = s["checksums"]
        if not c["failed"]:
            lines.append(f"checksums   all {c['verified']} blobs OK")
        else:
            lines.append(f"checksums   FAILED: {len(c['failed'])} of {c['verified']} blobs are corrupted")
            for f in c["failed"]:
                names = ", ".join(f["tensors"][:3]) + (" ..." if len(f["tensors"]) > 3 else "")
                lines.append(f"            blob {f['blob']} ({f['kind']}): {names}")
    else:
        lines.append("checksums   not verified (--no-verify)")
    if show_layers:
        lines.append("")
        lines.append(f"{'layer':48s} {'class':18s} {'in':>6s} {'out':>7s} {'bits':>4s} {'codes':8s} rotation")
        for name, m in header["layers"].items():
            lines.append(f"{name:48s} {m['class']:18s} {m['in_features']:6d} {m['out_features']:7d} "
                         f"{m['bits']:4d} {_codes(m):8s} {_rotation_mode(m['rotation'])}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="vqpipe inspect", description=__doc__.split("\n")[0])
    p.add_argument("file", help="a model.vqres file, or a reservoir directory holding one")
    p.add_argument("--layers", action="store_true", help="also list every quantized layer")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip hashing the blobs")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    path = _file(args.file)
    try:
        header, s = summary(path, args.verify)
    except ReservoirError as e:
        print(f"vqpipe inspect: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(s, indent=2, sort_keys=True) if args.json else render(header, s, args.layers))
    return 1 if s.get("checksums", {}).get("failed") else 0
