"""Summary of an A/B folder (ab.sh): per run wall, loop (the stage's \"quantized N layers in X s\" or calib_time's quantize_model wall), the rest, CPU-s, peak RSS, minor faults, the digest of the stage output (digest.py) and the SHA-256 of its reference.safetensors."""
import re, sys, glob, os, hashlib, subprocess
d = sys.argv[1]
def tv(log):
    s = open(log).read()
    g = lambda pat: re.search(pat, s)
    w = g(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)").group(1).split(":")
    wall = sum(float(x) * 60 ** i for i, x in enumerate(reversed(w)))
    u = float(g(r"User time \(seconds\): (\S+)").group(1)); sy = float(g(r"System time \(seconds\): (\S+)").group(1))
    rss = int(g(r"Maximum resident set size \(kbytes\): (\d+)").group(1))
    m = g(r"quantized \d+ layers in ([\d.]+)s") or g(r'"quantize_model_wall_s": ([\d.]+)')
    flt = int(g(r"Minor \(reclaiming a frame\) page faults: (\d+)").group(1))
    return wall, u, sy, rss, float(m.group(1)), flt
for log in sorted(glob.glob(f"{d}/*.log")):
    if "nohup" in log: continue
    try:
        wall, u, sy, rss, loop, flt = tv(log)
    except AttributeError:
        continue
    name = os.path.basename(log)[:-4]
    extra = ""
    q = f"{d}/q-{name}"
    if os.path.isdir(q):
        dig = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "digest.py"), q], capture_output=True, text=True).stdout.strip()
        ref = hashlib.sha256(open(f"{q}/reference.safetensors", "rb").read()).hexdigest()[:12]
        extra = f"digest {dig} ref {ref}"
    else:
        m = re.search(r'"digest": "(\w+)"', open(log).read())
        extra = f"digest {m.group(1)}" if m else "(no output dir here)"
    print(f"{name:10s} wall {wall:6.2f} loop {loop:6.2f} rest {wall-loop:5.2f} cpu {u+sy:6.1f} (user {u:6.1f} sys {sy:5.1f}) maxrss {rss} minflt {flt} {extra}")
