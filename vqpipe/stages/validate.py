"""The validate stage: check a reservoir reproduces the quantize stage's reference logits bit for bit.

In its own process it loads the reservoir with ``vqpipe.load`` (what a user would do), runs the
reference prompts the quantize stage ran, and compares tokens and float32 logits byte for byte with
``reference.safetensors`` of the quantized artifact.

Logits computed on another backend or BLAS differ in the last bits for reasons that have nothing to
do with the artifact, so the stage refuses to compare them: it first checks that this process runs
on the same backend, device, BLAS and MLX version as the process that made the reference.

Writes a JSON verdict (atomically) and exits with:
    0  bit-exact round trip
    1  not bit-exact (the verdict says which prompts differ and by how much)
    2  usage error or unreadable input
    3  refused: the reference was made on another backend / device / BLAS / MLX version
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

from .. import numerics

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3


def setup_differences(reference_env, current_env):
    """``["blas.name: 'openblas' (reference) != 'reference' (here)", ...]``; empty when comparable."""
    return numerics.differences(reference_env, current_env)


def compare_arrays(got, want):
    """(bit_exact, max_abs_diff) of two arrays; shapes and dtypes must match for bit-exactness."""
    import numpy as np

    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False, float("inf")
    exact = got.dtype == want.dtype and got.tobytes() == want.tobytes()
    if got.size == 0:
        return exact, 0.0
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if np.isnan(diff).any():
        same_nan = np.array_equal(np.isnan(got), np.isnan(want))
        diff = np.where(np.isnan(got) & np.isnan(want), 0.0, diff)
        if not same_nan:
            return exact, float("nan")
    return exact, float(diff.max())


def _finite(x):
    """``x`` or None when it is NaN/inf (JSON has no such numbers)."""
    return x if x is not None and math.isfinite(x) else None


def _reservoir_labels(reservoir_dir):
    """Best-effort (model, variant, persist) from the standard results/ layout."""
    parts = Path(reservoir_dir).resolve().parts
    if len(parts) >= 3 and parts[-1].startswith("persist-"):
        return parts[-3], parts[-2], parts[-1][len("persist-"):]
    return None, None, None


def run(reservoir, reference, model_name=None, variant=None, persist_rotation=None, progress=print):
    """The verdict dict; ``verdict["exit_code"]`` says how the stage should exit."""
    import mlx.core as mx

    from .. import load
    from ..bench.env import environment
    from ..store.quantized import REFERENCE_PROMPTS, reference_logits

    reservoir, reference = Path(reservoir), Path(reference)
    guess = _reservoir_labels(reservoir)
    verdict = {
        "kind": "validate",
        "model": model_name or guess[0],
        "variant": variant or guess[1],
        "persist_rotation": persist_rotation or guess[2],
        "reservoir": str(reservoir),
        "reference": str(reference),
        "bit_exact": False,
        "max_abs_diff": None,
        "n_prompts": 0,
        "prompts": [],
        "environment": None,
        "reference_environment": None,
        "reason": "",
    }
    meta = json.loads((reference / "reference.json").read_text())
    ref = mx.load(str(reference / "reference.safetensors"))
    here = environment()
    verdict["environment"] = here
    verdict["reference_environment"] = meta.get("environment")

    differences = setup_differences(meta.get("environment") or {}, here)
    if differences:
        verdict["bit_exact"] = None
        verdict["reason"] = (
            "refusing to compare: the reference logits were computed on a different setup ("
            + "; ".join(differences)
            + "). Run quantize and validate under the same backend and BLAS "
            "(config key `blas`, environment variable VQPIPE_BLAS)."
        )
        verdict["exit_code"] = EXIT_REFUSED
        return verdict
    if list(meta.get("prompts", [])) != list(REFERENCE_PROMPTS):
        verdict["reason"] = "reference.json lists other prompts than this vqpipe's REFERENCE_PROMPTS"
        verdict["exit_code"] = EXIT_MISMATCH
        return verdict

    t0 = time.perf_counter()
    model, tokenizer = load(reservoir)
    verdict["load_seconds"] = time.perf_counter() - t0
    progress(f"loaded {reservoir} in {verdict['load_seconds']:.2f}s")

    t0 = time.perf_counter()
    got = reference_logits(model, tokenizer)  # each layer decoded once for every prompt
    verdict["forward_seconds"] = time.perf_counter() - t0
    n = len(REFERENCE_PROMPTS)
    worst, failures = 0.0, []  # worst: None once a difference is not a finite number
    for i in range(n):
        tokens_ok, _ = compare_arrays(got[f"tokens.{i}"], ref[f"tokens.{i}"])
        if not tokens_ok:
            record = {"index": i, "tokens_match": False, "bit_exact": False, "max_abs_diff": None}
            failures.append(f"prompt {i}: tokenizer gives other tokens")
        else:
            exact, diff = compare_arrays(got[f"logits.{i}"], ref[f"logits.{i}"])
            record = {"index": i, "tokens_match": True, "bit_exact": exact, "max_abs_diff": _finite(diff),
                      "shape": list(ref[f"logits.{i}"].shape)}
            worst = max(worst, diff) if worst is not None and math.isfinite(diff) else None
            if not exact:
                failures.append(f"prompt {i}: logits differ (max |diff| {diff:.3g})")
        verdict["prompts"].append(record)
        progress(f"[{i + 1}/{n}] prompt {i}: " + ("bit-exact" if record["bit_exact"] else "DIFFERS"))
    verdict["n_prompts"] = n
    verdict["max_abs_diff"] = None if any(not r["tokens_match"] for r in verdict["prompts"]) else worst
    verdict["bit_exact"] = not failures
    verdict["reason"] = (
        f"all {n} prompts bit-exact" if not failures else "round trip is not bit-exact: " + "; ".join(failures)
    )
    verdict["exit_code"] = EXIT_OK if not failures else EXIT_MISMATCH
    return verdict


def main(argv=None):
    from ..store import record

    p = argparse.ArgumentParser(
        prog="vqpipe validate", description=__doc__.split("\n")[0],
        epilog="exit status: 0 bit-exact, 1 not bit-exact, 2 usage error, 3 refused (different setup)",
    )
    p.add_argument("--reservoir", required=True, help="reservoir directory (pack stage output)")
    p.add_argument("--reference", required=True, help="quantized artifact directory holding reference.*")
    p.add_argument("--out", required=True, help="verdict JSON file")
    p.add_argument("--model", help="model name recorded in the verdict (default: from the path)")
    p.add_argument("--variant", help="variant recorded in the verdict (default: from the path)")
    p.add_argument("--persist-rotation", choices=("on", "off"), help="recorded in the verdict (default: from the path)")
    args = p.parse_args(argv)
    for path, what in ((args.reservoir, "reservoir"), (args.reference, "reference")):
        if not Path(path).is_dir():
            print(f"vqpipe validate: error: {what} directory {path} does not exist", file=sys.stderr)
            return EXIT_USAGE
    for name in ("reference.json", "reference.safetensors"):
        if not (Path(args.reference) / name).is_file():
            print(f"vqpipe validate: error: {args.reference} has no {name}", file=sys.stderr)
            return EXIT_USAGE
    from ..store.manifest import ManifestError, verify

    try:  # both may come from a shared cache: a corrupted copy is named, not compared
        verify(args.reservoir)
        verify(args.reference)
    except ManifestError as e:
        print(f"vqpipe validate: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    verdict = run(args.reservoir, args.reference, args.model, args.variant, args.persist_rotation)
    code = verdict.pop("exit_code")
    record.write(args.out, "validate", verdict, inputs={"reservoir": args.reservoir, "reference": args.reference})
    print(f"verdict: bit_exact={verdict['bit_exact']} max_abs_diff={verdict['max_abs_diff']} -> {args.out}")
    print(verdict["reason"], file=sys.stdout if code == EXIT_OK else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
