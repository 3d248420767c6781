"""Summarise scripts/quantize_4b_memory.sh: peak RSS against the source size, per stage.

    python scripts/quantize_4b_summary.py RESULTS_DIR SOURCE_SAFETENSORS ARTIFACT_DIR

Writes RESULTS_DIR/summary.json and prints it. The peak is /usr/bin/time's maximum RSS; the 2 s
samples place it (the last output line before the highest sample) and give the load average.
"""

import json
import statistics
import sys
from pathlib import Path


def time_v(path):
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.strip().rpartition(": ")
        fields[key] = value
    wall = [float(x) for x in fields["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":")]
    seconds = sum(x * 60 ** i for i, x in enumerate(reversed(wall)))
    return {
        "max_rss_bytes": int(fields["Maximum resident set size (kbytes)"]) * 1024,
        "wall_seconds": seconds,
        "user_seconds": float(fields["User time (seconds)"]),
        "system_seconds": float(fields["System time (seconds)"]),
        "exit_status": int(fields["Exit status"]),
    }


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def placed_peak(samples, log):
    """(the sample with the highest RSS, the last output line printed before it)."""
    rows = [line.split() for line in samples.read_text().splitlines() if line.strip()]
    rows = [(int(r[0]), int(r[1]) * 1024, float(r[2]), int(r[5]) * 1024) for r in rows if len(r) == 6]
    if not rows:
        return None
    t, rss, _, _ = max(rows, key=lambda r: r[1])
    before = ""
    if log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            stamp, _, text = line.partition(" ")
            if stamp.isdigit() and int(stamp) <= t:
                before = text
    return {
        "sampled_peak_rss_bytes": rss, "seconds_into_run": t - rows[0][0], "last_line_before": before,
        "load1": spread([r[2] for r in rows]), "min_mem_available_bytes": min(r[3] for r in rows),
    }


def main(out, source, artifact):
    out, source, artifact = Path(out), Path(source), Path(artifact)
    source_bytes = source.stat().st_size
    summary = {"source_bytes": source_bytes}
    for stage in ("download", "quantize"):
        tv = out / f"{stage}.time-v.txt"
        if not tv.is_file():
            continue
        s = time_v(tv)
        s["peak_over_source"] = s["max_rss_bytes"] / source_bytes
        s["samples"] = placed_peak(out / f"{stage}.samples", out / f"{stage}.log")
        summary[stage] = s
    meta = artifact / "quantized.json"
    if meta.is_file():
        info = json.loads(meta.read_text())
        summary["artifact"] = {
            "quantized_safetensors_bytes": (artifact / "quantized.safetensors").stat().st_size,
            "quantize_seconds": info["quantize_seconds"],
            "peak_rss_bytes_at_quantize_end": info["peak_rss_bytes"],
            "layers": len(info["records"]),
        }
    text = json.dumps(summary, indent=2) + "\n"
    (out / "summary.json").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main(*sys.argv[1:])
