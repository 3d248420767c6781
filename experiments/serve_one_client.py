"""One client: `vqpipe serve` as users get it (``--decode auto``: a lone greedy request through the
compiled step on CUDA), `vqpipe serve --decode batched` (mlx-lm's batched generation loop for every
request) and the compiled decode step in this process (what `vqpipe generate` runs), on the same
reservoir, same prompts, greedy.

The servers run in subprocesses; this process loads the same reservoir for the in-process arm. Per
prompt (>= 20 distinct ones, arms interleaved per prompt after two warm-up prompts):
- ``serve`` / ``batched``: a streamed /v1/chat/completions request (one user turn), ``max_tokens`` new tokens,
  temperature 0; time to the first streamed chunk from the request, decode rate (completion tokens
  - 1) over the time from the first to the last chunk (usage from ``stream_options.include_usage``);
- ``compiled``: ``Decoder(model, ...).tokens`` on the same prompt ids (the chat template applied as
  the server applies it); time to the first id and
  the rate over the rest, measured the same way.
Prints per-arm median [min-max], the per-prompt ratios against ``batched``, and how many prompts
gave the same text in every arm (but for leading and trailing spaces: mlx-lm's server drops the
first token's leading space).

    python -m experiments.serve_one_client --model RESERVOIR [--prompts 20] [--max-tokens 64]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx

import vqpipe
from vqpipe.decode.step import Decoder

WORDS = ("lighthouse river winter market engine garden letter mountain violin harbour desert "
         "library clock forest bridge island candle station orchard comet").split()


def prompts(n):
    return [f"Write a short paragraph about a {w} and the person who looks after it." for w in
            (WORDS * (n // len(WORDS) + 1))[:n]]


def wait_ready(url, proc, limit=300):
    t = time.time()
    while time.time() - t < limit:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit("serve did not answer in time")


def serve_arm(url, name, text, max_tokens):
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    pieces, tokens = [], None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            msg = json.loads(line[5:])
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            for c in msg.get("choices", []):
                if (c.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    pieces.append(c["delta"]["content"])
    if first is None or tokens is None or tokens < 2:
        raise SystemExit(f"serve_one_client: {url} streamed {tokens} tokens of text for {text!r}; need 2 or more")
    return {"ttft_s": first - t0, "tok_s": (tokens - 1) / (last - first), "tokens": tokens, "text": "".join(pieces)}


def compiled_arm(model, tokenizer, text, max_tokens):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    mx.synchronize()
    t0 = time.perf_counter()
    out, first = [], None
    for i in Decoder(model, len(ids) + max_tokens, "split").tokens(mx.array(ids), max_tokens):
        out.append(i)
        first = first or time.perf_counter()
        if i in tokenizer.eos_token_ids:
            break
    last = time.perf_counter()
    return {"ttft_s": first - t0, "tok_s": (len(out) - 1) / (last - first), "tokens": len(out),
            "text": tokenizer.decode([i for i in out if i not in tokenizer.eos_token_ids])}


def summary(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8093)
    p.add_argument("--serve-decode", default="auto", help="the serve arm's --decode (default auto: as users get it)")
    p.add_argument("--out")
    a = p.parse_args()
    name = "m"
    urls = {"serve": f"http://127.0.0.1:{a.port}", "batched": f"http://127.0.0.1:{a.port + 1}"}
    procs = [subprocess.Popen([sys.executable, "-m", "vqpipe", "serve", "--model", a.model, "--port", str(a.port + i),
                               "--name", name, "--log-level", "WARNING", "--decode", decode])
             for i, decode in enumerate((a.serve_decode, "batched"))]
    arms = ("serve", "batched", "compiled")
    try:
        for url, proc in zip(urls.values(), procs):
            wait_ready(url, proc)
        model, tokenizer = vqpipe.load(a.model)
        rows = []
        for k, text in enumerate(prompts(a.prompts + 2)):
            row = {arm: serve_arm(urls[arm], name, text, a.max_tokens) for arm in arms[:2]}
            row["compiled"] = compiled_arm(model, tokenizer, text, a.max_tokens)
            if k < 2:
                continue  # warm-up
            rows.append(row)
            same = len({row[arm]["text"].strip() for arm in arms}) == 1
            print(f"prompt {k - 2:2d}: " + " | ".join(f"{arm} {row[arm]['tok_s']:6.1f} tok/s ttft "
                                                      f"{row[arm]['ttft_s'] * 1e3:6.1f} ms" for arm in arms)
                  + f" | same text {same}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    res = {arm: {k: summary([r[arm][k] for r in rows]) for k in ("tok_s", "ttft_s")} for arm in arms}
    for arm in ("serve", "compiled"):
        res[f"{arm}_over_batched_tok_s"] = summary([r[arm]["tok_s"] / r["batched"]["tok_s"] for r in rows])
        res[f"{arm}_over_batched_ttft"] = summary([r[arm]["ttft_s"] / r["batched"]["ttft_s"] for r in rows])
    res["same_text"] = sum(len({r[arm]["text"].strip() for arm in arms}) == 1 for r in rows)
    res["device"] = str(mx.default_device())
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": res, "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
