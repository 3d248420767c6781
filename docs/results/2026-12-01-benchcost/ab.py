"""A/B: run each arm's command in a fresh process, interleaved, n rounds; CPU-s (user+sys of the child tree) per run."""
import json, os, resource, subprocess, sys, time, statistics
spec = json.load(open(sys.argv[1])); n = int(sys.argv[2]); out = sys.argv[3]
res = {a["name"]: [] for a in spec}
for r in range(n):
    for a in spec:
        env = {**os.environ, "PYTHONPATH": a["pythonpath"]}
        before = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.perf_counter()
        p = subprocess.run(a["cmd"], shell=True, env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        sysc = after.ru_stime - before.ru_stime
        res[a["name"]].append({"cpu": cpu, "sys": sysc, "wall": time.perf_counter() - t0, "rc": p.returncode, "load": os.getloadavg()[0]})
        print(f"round {r} {a['name']}: cpu {cpu:.2f} (sys {sysc:.2f}) wall {time.perf_counter() - t0:.1f} rc {p.returncode} load {os.getloadavg()[0]:.1f}", flush=True)
        if p.returncode not in (0,) and not a.get("rc_ok"):
            print(p.stderr[-2000:])
json.dump(res, open(out, "w"), indent=1)
for k, v in res.items():
    c = sorted(x["cpu"] for x in v)
    print(f"{k}: CPU-s median {statistics.median(c):.2f} [{c[0]:.2f}-{c[-1]:.2f}] n={len(c)}")
