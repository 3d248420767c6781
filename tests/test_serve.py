"""``vqpipe serve`` (through the openai client and raw HTTP), ``vqpipe generate`` and ``vqpipe chat``,
each as a subprocess on a 4-bit reservoir of ``synth:tiny``."""

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the test extra pins openai; this interpreter lacks it (e.g. the GPU host)")

from vqpipe.apps.serve import COMPILED_MAX_POSITIONS, context_length

PY = [sys.executable, "-m", "vqpipe"]
USER = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def reservoir(tiny_b4_reservoir):
    return tiny_b4_reservoir


@pytest.fixture(scope="module")
def local_model(reservoir):
    from vqpipe.apps.generate import load_model

    return load_model(reservoir)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _running_server(reservoir, log_dir, *extra):
    port = _free_port()
    log = open(log_dir / "server.log", "w+")
    proc = subprocess.Popen(PY + ["serve", "--model", str(reservoir), "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    try:
        while True:
            assert proc.poll() is None, f"server exited: {open(log.name).read()}"
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                assert time.time() < deadline, "server did not come up in 60 s"
                time.sleep(0.2)
        yield {"port": port, "url": url, "proc": proc, "log": log.name}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0, open(log.name).read()[-2000:]


@pytest.fixture(scope="module")
def server(reservoir, tmp_path_factory):
    with _running_server(reservoir, tmp_path_factory.mktemp("serve-log"), "--name", "tiny-b4") as s:
        yield s


@pytest.fixture(scope="module")
def batched_server(reservoir, tmp_path_factory):
    """mlx-lm's batch loop for every request: the reference for the compiled path."""
    with _running_server(reservoir, tmp_path_factory.mktemp("serve-batched-log"), "--name", "tiny-b4",
                         "--decode", "batched") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server, path, raw, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=30)
    h = {"Content-Type": "application/json", "Content-Length": str(len(raw))}
    h.update(headers or {})
    c.putrequest("POST", path)
    for k, v in h.items():
        c.putheader(k, v)
    c.endheaders()
    c.send(raw)
    r = c.getresponse()
    return r.status, json.loads(r.read())


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny-b4"]
    assert client.models.retrieve("tiny-b4").id == "tiny-b4"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_completion_usage_and_length(client, local_model):
    _, tok = local_model
    r = client.chat.completions.create(model="tiny-b4", messages=USER, max_tokens=6)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(USER, add_generation_prompt=True))
    assert r.choices[0].message.content


def test_completion_matches_local_generate(client, local_model):
    from mlx_lm import generate

    model, tok = local_model
    prompt = "The quick brown fox"
    r = client.completions.create(model="tiny-b4", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == generate(model, tok, prompt, max_tokens=12)


def test_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(model="tiny-b4", messages=USER, max_tokens=10)
    chunks = list(client.chat.completions.create(model="tiny-b4", messages=USER, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # came in pieces
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def _concurrent_then_sequential(client):
    """Four completions at once (every other one streamed), then the same four one by one."""
    prompts = [f"Item {i}: a story about" for i in range(4)]

    def one(i):
        if i % 2:
            parts = client.completions.create(model="tiny-b4", prompt=prompts[i], max_tokens=6, stream=True)
            return "".join(p.choices[0].text for p in parts)
        return client.completions.create(model="tiny-b4", prompt=prompts[i], max_tokens=6).choices[0].text

    out = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(i))) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(o, str) and o for o in out)
    return out, [one(i) for i in range(len(prompts))]


def test_concurrent_requests_match_sequential(client):
    out, sequential = _concurrent_then_sequential(client)
    assert out == sequential


@pytest.mark.parametrize("raw, status, needle", [
    (b'{"messages": [', 400, "invalid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"messages": "hi"}', 400, "non-empty list"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n must be 1"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}',
     400, "only text"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 5}}', 400, "logit_bias"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": -1}', 400, "seed"),
])
def test_bad_request_bodies(server, raw, status, needle):
    got, body = _post(server, "/v1/chat/completions", raw)
    assert got == status and needle in json.dumps(body)


def test_bad_content_length_and_path(server):
    c = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=10)
    c.request("POST", "/v1/chat/completions", body=b"{}", headers={"Content-Length": "-1"})
    r = c.getresponse()
    assert r.status == 400 and "Content-Length" in json.loads(r.read())["error"]["message"]
    assert _post(server, "/v1/nothing", b"{}")[0] == 404


def test_bad_requests_through_client(client, local_model):
    _, tok = local_model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=USER, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny-b4", messages=USER, max_tokens=10**12)
    with pytest.raises(openai.BadRequestError, match="exceeds"):
        client.chat.completions.create(model="tiny-b4", messages=USER, max_tokens=32768)
    long = "sea and sky " * 12000
    assert len(tok.encode(long)) > 32768
    with pytest.raises(openai.BadRequestError, match="context") as e:
        client.completions.create(model="tiny-b4", prompt=long, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    # A stream_options without include_usage broke mlx-lm's stream; it is completed here.
    chunks = list(client.chat.completions.create(model="tiny-b4", messages=USER, max_tokens=3, stream=True,
                                                 stream_options={}))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_server_still_serves_after_bad_requests(server, client):
    # An empty prompt killed mlx-lm's generation thread (every later request failed).
    for raw in (b"{", b'{"prompt": 5}', b'{"model": "x", "prompt": "a"}', b'{"prompt": ""}'):
        assert 400 <= _post(server, "/v1/completions", raw)[0] < 500
    # A client that leaves in the middle of a stream.
    with socket.create_connection(("127.0.0.1", server["port"])) as s:
        body = json.dumps({"prompt": "Hello", "max_tokens": 400, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert s.recv(64).startswith(b"HTTP/1.0 200")
    assert server["proc"].poll() is None
    assert client.completions.create(model="tiny-b4", prompt="Hello", max_tokens=3).usage.completion_tokens == 3


def test_lone_requests_through_the_compiled_step_answer_as_the_batch_loop(reservoir, batched_server, tmp_path):
    """``--decode compiled`` (what auto picks on the CPU and CUDA): a lone greedy request decodes through the
    compiled step and gets the batch loop's answer (text, finish reason, usage, logprobs and top
    logprobs, stop words, streaming); a sampled request, and overlapping ones, still go to mlx-lm."""
    bodies = [
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                             "logprobs": True, "top_logprobs": 3}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 9, "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
    ]
    batched = [_post(batched_server, path, json.dumps(b).encode()) for path, b in bodies]
    with _running_server(reservoir, tmp_path, "--name", "tiny-b4", "--decode", "compiled") as s:
        compiled = [_post(s, path, json.dumps(b).encode()) for path, b in bodies]
        # a stop word cut where the batch loop cuts it (the first piece of the text it stops at)
        text = compiled[1][1]["choices"][0]["message"]["content"]
        for k in range(1, len(text) - 3):
            stopped = {"messages": USER, "max_tokens": 9, "stop": [text[k:k + 3]]}
            cut = [_post(x, "/v1/chat/completions", json.dumps(stopped).encode()) for x in (batched_server, s)]
            if cut[0][1]["choices"][0]["finish_reason"] == "stop":
                break
        c = openai.OpenAI(base_url=s["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = list(c.chat.completions.create(model="tiny-b4", messages=USER, max_tokens=9, stream=True))
        streamed = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
        c.completions.create(model="tiny-b4", prompt="Hi", max_tokens=4, temperature=0.7, seed=3)
        # past COMPILED_MAX_POSITIONS: mlx-lm's growing cache (read the first token, then hang up)
        with socket.create_connection(("127.0.0.1", s["port"]), timeout=60) as held:
            body = json.dumps({"prompt": "Hi", "max_tokens": COMPILED_MAX_POSITIONS, "stream": True}).encode()
            held.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while b"data: " not in got and (part := held.recv(4096)):
                got += part
            assert b"data: " in got, got[:200]
        log = open(s["log"]).read()
    assert log.count("compiled step: a lone request") == len(bodies) + k + 1  # not the sampled one
    for (status_b, b), (status_c, c) in zip(batched, compiled):
        assert status_b == status_c == 200
        cb, cc = b["choices"][0], c["choices"][0]
        assert cc["finish_reason"] == cb["finish_reason"] == "length"
        assert cc.get("text", cc.get("message")) == cb.get("text", cb.get("message"))
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):  # cached_tokens: each server's own history
            assert c["usage"][k] == b["usage"][k]
        if cb.get("logprobs"):
            lb, lc = cb["logprobs"], cc["logprobs"]
            if "content" in lb:  # chat: per token its logprob and its top ones
                lb = [(t["logprob"], [u["token"] for u in t["top_logprobs"]]) for t in lb["content"]]
                lc = [(t["logprob"], [u["token"] for u in t["top_logprobs"]]) for t in lc["content"]]
                assert [t for _, t in lc] == [t for _, t in lb]
                assert [v for v, _ in lc] == pytest.approx([v for v, _ in lb], abs=1e-4)
            else:
                assert lc["tokens"] == lb["tokens"]
                assert lc["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
    assert cut[0][0] == cut[1][0] == 200
    assert cut[1][1]["choices"][0] == cut[0][1]["choices"][0] and cut[1][1]["choices"][0]["finish_reason"] == "stop"
    assert streamed == compiled[1][1]["choices"][0]["message"]["content"]


def test_compiled_lone_requests_reuse_the_prompt_cache(reservoir, batched_server, tmp_path):
    """A second chat turn on the compiled path starts from what the first left in mlx-lm's prompt
    cache (cached_tokens > 0) and answers as the batch loop does."""
    first = {"messages": USER, "max_tokens": 6, "logprobs": True}
    with _running_server(reservoir, tmp_path, "--name", "tiny-b4", "--decode", "compiled") as s:
        answers = []
        for x in (batched_server, s):
            status, one = _post(x, "/v1/chat/completions", json.dumps(first).encode())
            assert status == 200
            second = {"messages": USER + [one["choices"][0]["message"], {"role": "user", "content": "And the sky?"}],
                      "max_tokens": 6, "logprobs": True}
            answers.append((one, _post(x, "/v1/chat/completions", json.dumps(second).encode())[1]))
        log = open(s["log"]).read()
    (b1, b2), (c1, c2) = answers
    assert c1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < c2["usage"]["prompt_tokens_details"]["cached_tokens"] < c2["usage"]["prompt_tokens"]
    assert log.count("compiled step: a lone request") == 2
    for b, c in ((b1, c1), (b2, c2)):
        assert c["choices"][0]["message"] == b["choices"][0]["message"]
        lb = [t["logprob"] for t in b["choices"][0]["logprobs"]["content"]]
        lc = [t["logprob"] for t in c["choices"][0]["logprobs"]["content"]]
        assert lc == pytest.approx(lb, abs=1e-4)


def test_overlapping_requests_with_compiled_decode_match_sequential(reservoir, tmp_path):
    with _running_server(reservoir, tmp_path, "--name", "tiny-b4", "--decode", "compiled") as s:
        c = openai.OpenAI(base_url=s["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        out, sequential = _concurrent_then_sequential(c)
        log = open(s["log"]).read()
    assert out == sequential
    assert log.count("compiled step: a lone request") >= len(out)  # the sequential ones at least


def _post_until_admitted(server, body, seconds=60):
    """POST /v1/completions, retrying while the server answers 429: a request's slot is released
    just after its response is sent, so the next request can arrive before that."""
    deadline = time.time() + seconds
    while (got := _post(server, "/v1/completions", json.dumps(body).encode()))[0] == 429:
        assert time.time() < deadline, "still 429 after 60 s"
        time.sleep(0.1)
    return got


def _local_logprobs(model, tok, prompt, n, cache):
    from mlx_lm.generate import stream_generate

    return [r.logprobs[r.token].item() for r in stream_generate(model, tok, prompt, max_tokens=n, prompt_cache=cache)]


def test_serve_with_kivi_cache_and_max_pending(reservoir, local_model, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    from vqpipe.kivi import make_kivi_cache

    model, tok = local_model
    prompts = ["The sea is", "A stone and a river"]
    args = ("--kv-bits", "2", "--kv-cache", "reference", "--kv-group-size", "4", "--kv-residual", "4",
            "--max-pending", "1")
    with _running_server(reservoir, tmp_path, *args) as s:
        out = [_post_until_admitted(s, {"prompt": p, "max_tokens": 8, "logprobs": True}) for p in prompts]
        # One request in flight (a stream that has sent its first token) fills --max-pending 1.
        deadline = time.time() + 60
        while True:
            held = socket.create_connection(("127.0.0.1", s["port"]), timeout=60)
            body = json.dumps({"prompt": "Hello", "max_tokens": 200, "stream": True}).encode()
            held.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while b"data: " not in got and (part := held.recv(4096)):
                got += part
            if b"data: " in got:
                break
            held.close()
            assert b" 429 " in got.split(b"\r\n")[0] and time.time() < deadline, got[:200]
            time.sleep(0.2)
        with held:
            status, err = _post(s, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
            assert status == 429 and "too many requests" in err["error"]["message"]
        # The held stream's slot is freed at its next write, which fails.
        assert _post_until_admitted(s, {"prompt": "x", "max_tokens": 2})[0] == 200
    # Each request with its own KIVI cache: the library's figures with that cache, which are not
    # those of the full-precision cache.
    for p, (status, body) in zip(prompts, out):
        assert status == 200
        served = [x["logprob"] for x in body["choices"][0]["logprobs"]["content"]]
        kivi = _local_logprobs(model, tok, p, 8, make_kivi_cache(model, 2, 4, 4, packed=False))
        plain = _local_logprobs(model, tok, p, 8, make_prompt_cache(model))
        assert len(served) == len(kivi) == 8 and served == pytest.approx(kivi, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(kivi, plain)) > 1e-3


def _load_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "load_serve.py"
    spec = importlib.util.spec_from_file_location("load_serve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_load_script_against_server(server, tmp_path, capsys):
    script = _load_script()
    out = tmp_path / "load.json"
    assert script.main(["--url", server["url"], "--clients", "1,3", "--requests", "3", "--max-tokens", "2",
                        "--warmup", "1", "--time-limit", "120", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [lv["clients"] for lv in doc["levels"]] == [1, 3]
    for lv in doc["levels"]:
        assert lv["done"] == 3 and lv["failed"] == 0 and lv["tokens_per_s"] > 0
        assert lv["latency_s"]["n"] == 3 and lv["latency_s"]["min"] <= lv["latency_s"]["median"]
        assert lv["ttft_s"] is None or lv["ttft_s"]["max"] <= lv["latency_s"]["max"]
    assert "clients 3: 3 done" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.main(["--url", "http://example.com:8080", "--requests", "1"])


def test_serve_refuses_what_it_cannot_serve(reservoir, tmp_path, capsys, server):
    from vqpipe.apps import serve

    assert serve.main(["--model", str(tmp_path)]) == 2
    assert "not a reservoir directory" in capsys.readouterr().err
    assert serve.main(["--model", str(reservoir), "--port", str(server["port"])]) == 2
    assert f"cannot listen on 127.0.0.1:{server['port']}" in capsys.readouterr().err


def test_context_length_from_config(reservoir):
    assert context_length(reservoir) == (32768, 8192)
    assert context_length(reservoir, 256)[0] == 256


def _run(args, stdin=None):
    return subprocess.run(PY + args, input=stdin, capture_output=True, text=True, timeout=120)


def test_generate_cli_kivi_matches_library(reservoir, local_model):
    from mlx_lm import generate

    from vqpipe.apps.generate import encode_prompt
    from vqpipe.kivi import make_kivi_cache

    r = _run(["generate", "--model", str(reservoir), "--prompt", "Hello sea", "--max-tokens", "8",
              "--kv-bits", "4", "--kv-cache", "reference", "--kv-group-size", "4", "--kv-residual", "4"])
    assert r.returncode == 0, r.stderr
    text = r.stdout.split("==========\n")[1].rstrip("\n")
    model, tok = local_model
    prompt = encode_prompt(tok, "Hello sea", True)
    assert text == generate(model, tok, prompt, max_tokens=8, prompt_cache=make_kivi_cache(model, 4, 4, 4, packed=False))
    assert f"Prompt: {len(prompt)} tokens" in r.stdout and "Generation: 8 tokens" in r.stdout
    assert "Peak memory:" in r.stdout and "KV cache (KIVI):" in r.stdout


def test_generate_errors_and_stdin(reservoir, tmp_path, capsys, monkeypatch):
    import io

    from vqpipe.apps import generate

    assert generate.main(["--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a reservoir directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        generate.main(["--model", str(reservoir), "--prompt", "x", "--max-tokens", "0"])
    assert e.value.code == 2 and "--max-tokens" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert generate.main(["--model", str(reservoir), "--prompt", "-", "--no-chat-template", "-m", "3"]) == 0
    assert "Generation: 3 tokens" in capsys.readouterr().out


def test_chat_cli_piped_keeps_cache(reservoir, local_model):
    _, tok = local_model
    r = _run(["chat", "--model", str(reservoir), "--max-tokens", "6", "--kv-bits", "2", "--kv-cache", "reference"],
             "Hello sea\nAnd the sky?\nr\nHello sea\nq\nnever read\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    assert len(replies) == 3 and replies[0] and replies[2] == replies[0]  # r starts over
    turns = [int(line.split("prompt ")[1].split(" tokens")[0])
             for line in r.stderr.splitlines() if line.startswith("[6 tokens")]
    first = tok.apply_chat_template([{"role": "user", "content": "Hello sea"}], add_generation_prompt=True)
    assert turns[0] == turns[2] == len(first)
    # The second turn feeds less than the whole conversation: the first turn's prompt was cached.
    convo = [{"role": "user", "content": "Hello sea"}, {"role": "assistant", "content": replies[0]},
             {"role": "user", "content": "And the sky?"}]
    assert turns[1] <= len(tok.apply_chat_template(convo, add_generation_prompt=True)) - len(first)
    assert "reset" in r.stderr
    # The first reply is what generate gives for the same templated message (greedy, same KIVI cache).
    from mlx_lm import generate

    from vqpipe.kivi import make_kivi_cache

    model, _ = local_model
    assert replies[0] == generate(model, tok, first, max_tokens=6, prompt_cache=make_kivi_cache(model, 2, packed=False))


def test_chat_through_the_compiled_step_answers_as_mlx_lm_loop(reservoir):
    """chat's default on the CPU (greedy, full-precision cache): the compiled step, the cache carried
    between turns; the same replies and the same prompt tokens fed per turn as mlx-lm's loop
    (``--compiled off``), a reset included."""
    lines = "Hello sea\nAnd the sky?\nWhat else?\nr\nHello sea\nq\n"
    runs = {m: _run(["chat", "--model", str(reservoir), "--max-tokens", "7", "--compiled", m], lines)
            for m in ("auto", "off")}
    for r in runs.values():
        assert r.returncode == 0, r.stderr
    fed = {m: [line.split("prompt ")[1].split(" tokens")[0] for line in r.stderr.splitlines() if line.startswith("[")]
           for m, r in runs.items()}
    assert runs["auto"].stdout == runs["off"].stdout and len(runs["auto"].stdout.splitlines()) == 4
    assert fed["auto"] == fed["off"]  # the same cache reuse turn by turn (the first turn's prompt at least)
    assert "compiled step (split)" in runs["auto"].stderr and "compiled step" not in runs["off"].stderr
    r = _run(["chat", "--model", str(reservoir), "--compiled", "split", "--temp", "0.5"], "hi\n")
    assert r.returncode == 2 and "greedily" in r.stderr


def test_packed_kivi_cache_in_generate_chat_and_serve(reservoir, local_model, tmp_path):
    """--kv-bits (the packed cache by default): generate, chat and serve run the packed cache (codes resident, attention reading
    them) and give what the library gives with that cache; past the residual, so codes are read.

    The prompts are long enough (34 templated, 31 raw tokens) that the first group of 32 is
    flushed in the first few decode steps and the later steps attend over codes: 12 generated
    tokens do what 40 after a short prompt did, at a third of the decode steps (~0.1-0.3 s each here)."""
    from mlx_lm import generate

    from vqpipe.apps.generate import encode_prompt
    from vqpipe.kivi import make_kivi_cache

    model, tok = local_model
    chat_text = "Hello sea, tell me about the waves, the tides and the wind tonight."
    raw = "The sea is calm tonight and the tide is full; the boats are in the harbour, the gulls are quiet and"
    kv = ["--kv-bits", "4", "--kv-group-size", "32", "--kv-residual", "4"]
    r = _run(["generate", "--model", str(reservoir), "--prompt", chat_text, "--max-tokens", "12", *kv])
    assert r.returncode == 0, r.stderr
    text = r.stdout.split("==========\n")[1].rstrip("\n")
    prompt = encode_prompt(tok, chat_text, True)
    assert len(prompt) + 12 - 4 - 32 >= 4  # at least 4 steps after the first flush
    cache = make_kivi_cache(model, 4, 32, 4, packed=True)
    assert text == generate(model, tok, prompt, max_tokens=12, prompt_cache=cache)
    assert cache[0].quantized >= 32 and "KV cache (KIVI):" in r.stdout
    # chat keeps the packed cache between turns (trimmed to the common prefix)
    r = _run(["chat", "--model", str(reservoir), "--max-tokens", "6", *kv], f"{chat_text}\nAnd the sky?\nq\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    assert len(replies) == 2 and replies[0] == generate(model, tok, prompt, max_tokens=6,
                                                        prompt_cache=make_kivi_cache(model, 4, 32, 4, packed=True))
    with _running_server(reservoir, tmp_path, *kv) as s:
        status, body = _post_until_admitted(s, {"prompt": raw, "max_tokens": 12, "logprobs": True})
    assert status == 200
    served = [x["logprob"] for x in body["choices"][0]["logprobs"]["content"]]
    cache = make_kivi_cache(model, 4, 32, 4, packed=True)
    want = _local_logprobs(model, tok, raw, 12, cache)
    assert cache[0].quantized >= 32
    assert len(served) == 12 and served == pytest.approx(want, abs=1e-4)


def test_packed_kivi_options_checked(reservoir, capsys):
    from vqpipe.apps import generate

    for extra, needle in ((["--kv-bits", "4", "--kv-group-size", "4"], "multiple of 8"),
                          (["--kv-bits", "2", "--kv-group-size", "8"], "--kv-cache reference")):
        with pytest.raises(SystemExit) as e:
            generate.main(["--model", str(reservoir), "--prompt", "x", *extra])
        assert e.value.code == 2 and needle in capsys.readouterr().err
