"""Per-job CPU seconds and wall times of a Snakemake run, from scripts/job_cpu_hook.sh's log.

    python scripts/job_times.py job-times.log [--jobs]

Prints, per rule and model: jobs, CPU seconds (the job's processes, children included), wall
seconds (sum, and the longest job); then the run's span and total CPU. --jobs lists every job
in start order (offset from the first start, wall, CPU).
"""

import argparse
import re
import sys
from collections import defaultdict


def _seconds(t):
    m, s = t.rstrip("s").split("m")
    return int(m) * 60 + float(s)


def parse(path):
    """[(start, end, cpu, stage, label)] from the hook's log."""
    jobs, lines = [], open(path).read().splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("JOB "):
            continue
        _, t0, t1, cmd = line.split(" ", 3)
        children = lines[i + 2].split()  # `times`: the shell's line, then its children's
        cpu = sum(_seconds(t) for t in lines[i + 1].split() + children)
        stage = cmd.split()[3]
        jobs.append((float(t0), float(t1), cpu, *label(stage, cmd)))
    return sorted(jobs)


def label(stage, cmd):
    """(rule, model, job) of a stage command, from its flags and output path."""
    out = re.search(r"--(?:out|reference-out) (\S+)", cmd)
    out = out.group(1).strip("'") if out else "?"
    parts = out.split("/")
    model = parts[2] if len(parts) > 2 and parts[1] in ("models", "quantized", "reservoir", "validate",
                                                         "calibration", "bench") else "-"
    if out.endswith("kivi.json"):
        model = "-"
    rule = stage
    if stage == "bench-quality":
        rule = ("bench-quality-merge" if "--merge" in cmd else "bench-quality-ref" if "--reference-out" in cmd
                else "bench-quality-arm" if "--reference " in cmd else "bench-quality-shard")
    return rule, model, "/".join(parts[3:]) or out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--jobs", action="store_true", help="also list every job")
    args = p.parse_args(argv)
    jobs = parse(args.log)
    if not jobs:
        sys.exit(f"{args.log}: no jobs")
    first, last = jobs[0][0], max(j[1] for j in jobs)
    groups = defaultdict(list)
    for t0, t1, cpu, rule, model, _ in jobs:
        groups[(rule, model)].append((t1 - t0, cpu))
    print(f"{'rule':22s} {'model':11s} {'jobs':>4s} {'CPU-s':>8s} {'wall-s':>8s} {'longest':>8s}")
    for (rule, model), v in sorted(groups.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        print(f"{rule:22s} {model:11s} {len(v):4d} {sum(c for _, c in v):8.1f} {sum(w for w, _ in v):8.1f} "
              f"{max(w for w, _ in v):8.1f}")
    total = sum(j[2] for j in jobs)
    print(f"{'total':22s} {'':11s} {len(jobs):4d} {total:8.1f}   span {last - first:.1f} s wall "
          f"(first job start to last job end)")
    if args.jobs:
        for t0, t1, cpu, rule, model, job in jobs:
            print(f"{t0 - first:8.1f} {t1 - t0:7.1f} {cpu:7.1f}  {rule} {model} {job}")


if __name__ == "__main__":
    main()
