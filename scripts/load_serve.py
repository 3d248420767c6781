"""Bounded load test of ``vqpipe serve``: throughput and latency for N concurrent clients.

    .venv/bin/python scripts/load_serve.py --model results/reservoir/tiny/b4-auto/persist-off \
        --clients 1,4,8 --requests 32 --max-tokens 32 --time-limit 600

Starts the server on a free localhost port (or talks to --url, which must be localhost), sends a
fixed number of streaming /v1/completions requests per concurrency level from N client threads
(distinct prompts, greedy, fixed max_tokens), and stops by itself: no new request starts after
--time-limit seconds, every socket times out at the deadline, and the server it started is
stopped. Prints per level: requests done/failed, wall time, requests/s, generated tokens/s and the
latency and time-to-first-token medians, p99, [min-max] and n. --out writes the figures as JSON.
"""

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np

LOCAL = ("127.0.0.1", "localhost", "::1")
WORDS = ("sea sky river stone light wind field city night garden road bird tree snow fire glass "
         "cloud hill letter window").split()


def prompts(n, tag):
    """n distinct prompts of similar length; the tag keeps levels apart (no prompt-cache hits)."""
    return [f"{tag} prompt {i}: write about the {WORDS[i % len(WORDS)]} and the {WORDS[(7 * i + 3) % len(WORDS)]}"
            for i in range(n)]


def one_request(host, port, prompt, max_tokens, deadline):
    """(latency s, time to first token s, completion tokens) of one streaming completion."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=max(deadline - time.time(), 1))
    try:
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        first, tokens = None, 0
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return time.perf_counter() - t0, first, tokens
    finally:
        c.close()


def run_level(host, port, clients, texts, max_tokens, deadline):
    """Send every prompt once from ``clients`` threads; the per-request results and the wall time."""
    todo, lock, results, errors = list(texts), threading.Lock(), [], []

    def worker():
        while time.time() < deadline:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            try:
                results.append(one_request(host, port, prompt, max_tokens, deadline))
            except Exception as e:  # counted, reported, never fatal to the run
                errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors, time.perf_counter() - t0


def summary(values):
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if not len(v):
        return None
    return {"median": float(np.median(v)), "p99": float(np.percentile(v, 99)), "min": float(v.min()),
            "max": float(v.max()), "n": int(len(v))}


def fmt(s, unit="s"):
    if s is None:
        return "-"
    return f"{s['median']:.3f} {unit} (p99 {s['p99']:.3f}) [{s['min']:.3f}-{s['max']:.3f}] n={s['n']}"


def start_server(model, port):
    cmd = [sys.executable, "-m", "vqpipe", "serve", "--model", model, "--port", str(port), "--log-level",
           "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while time.time() - t0 < 120:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start in 120 s")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="reservoir directory: start a server on it (localhost, free port)")
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080 (localhost only)")
    p.add_argument("--clients", default="1,4,8", help="concurrency levels, comma-separated (default 1,4,8)")
    p.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--warmup", type=int, default=2, help="requests before measuring (default 2)")
    p.add_argument("--time-limit", type=float, default=600, help="seconds for the whole run (default 600)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.clients.split(",")]
    if min(levels) < 1 or args.requests < 1 or not 1 <= args.max_tokens <= 4096 or args.time_limit <= 0:
        p.error("--clients, --requests must be >= 1, --max-tokens in 1..4096, --time-limit > 0")
    deadline = time.time() + args.time_limit
    proc = None
    if args.url:
        u = urllib.parse.urlparse(args.url)
        if u.hostname not in LOCAL:
            p.error(f"--url must be on this machine (one of {LOCAL}), got {u.hostname!r}")
        host, port = u.hostname, u.port or 80
    else:
        host, port = "127.0.0.1", free_port()
        proc = start_server(args.model, port)
    doc = {"model": args.model or args.url, "max_tokens": args.max_tokens, "requests": args.requests,
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
           "loadavg_start": os.getloadavg(), "levels": []}
    try:
        run_level(host, port, 1, prompts(args.warmup, "Warmup"), args.max_tokens, deadline)
        for n in levels:
            texts = prompts(args.requests, f"Level {n}")
            results, errors, wall = run_level(host, port, n, texts, args.max_tokens, deadline)
            tokens = sum(r[2] for r in results)
            level = {"clients": n, "done": len(results), "failed": len(errors), "errors": errors[:5],
                     "wall_s": wall, "requests_per_s": len(results) / wall, "tokens_per_s": tokens / wall,
                     "latency_s": summary([r[0] for r in results]), "ttft_s": summary([r[1] for r in results])}
            doc["levels"].append(level)
            print(f"clients {n}: {len(results)} done, {len(errors)} failed in {wall:.1f} s; "
                  f"{level['requests_per_s']:.2f} req/s, {level['tokens_per_s']:.1f} generated tok/s\n"
                  f"  latency {fmt(level['latency_s'])}\n  first token {fmt(level['ttft_s'])}", flush=True)
            if time.time() >= deadline:
                print("time limit reached; later levels skipped", flush=True)
                break
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    doc["loadavg_end"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {doc['loadavg_start']}, at end {doc['loadavg_end']}")
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(args.out)
    return 0 if all(lv["failed"] == 0 for lv in doc["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
