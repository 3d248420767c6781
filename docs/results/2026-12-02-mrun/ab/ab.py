"""Interleaved A/B of a stage command: python ab.py N OUTDIR -- ARM=PYTHONPATH[,ENV=V...] ... -- CMD...
Each run is a fresh process tree; CPU-s = user + sys of the process and its waited-for children
(os.wait4 of a shell). Writes OUTDIR/ab.jsonl and prints median [min-max]."""
import json, os, subprocess, sys, time, statistics
n = int(sys.argv[1]); outdir = sys.argv[2]
rest = sys.argv[3:]
i = rest.index("--"); arms_spec = rest[:i]; cmd = rest[i + 1:]
arms = {}
for spec in arms_spec:
    name, _, env = spec.partition("=")
    parts = env.split(",")
    e = {"PYTHONPATH": parts[0]}
    for kv in parts[1:]:
        k, _, v = kv.partition("=")
        e[k] = v
    arms[name] = e
os.makedirs(outdir, exist_ok=True)
res = {a: [] for a in arms}
log = open(os.path.join(outdir, "ab.jsonl"), "a")
for r in range(n):
    for a, e in arms.items():
        c = [x.replace("{arm}", a).replace("{r}", str(r)) for x in cmd]
        env = {**os.environ, **e}
        t0 = time.perf_counter()
        p = subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(outdir, f"{a}-{r}.log"), "w"))
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        rec = {"arm": a, "round": r, "user": ru.ru_utime, "sys": ru.ru_stime, "cpu": ru.ru_utime + ru.ru_stime,
               "wall": wall, "rc": os.waitstatus_to_exitcode(status), "load": os.getloadavg()[0], "maxrss_kb": ru.ru_maxrss}
        res[a].append(rec); log.write(json.dumps(rec) + "\n"); log.flush()
        print(json.dumps(rec), flush=True)
for a, v in res.items():
    for key in ("cpu", "user", "sys"):
        xs = [x[key] for x in v]
        print(f"{a:10s} {key:4s} median {statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}] n={len(xs)}")
