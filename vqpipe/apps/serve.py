"""Serve a reservoir over an OpenAI-compatible HTTP API: ``vqpipe serve --model DIR``.

This is mlx_lm.server (its HTTP handler, its generation thread with batching, its prompt cache)
with two pieces plugged in: a ModelProvider that loads with ``vqpipe.load`` and serves that one
reservoir only, and a handler that checks each request before mlx-lm sees it. mlx-lm 0.32.2 left
these open (docs/serving.md has what it does with each): an unknown model name is looked up on the
Hugging Face hub and unloads the served model, ``max_tokens`` has no upper bound and a prompt no
length limit, a negative Content-Length blocks a handler thread, http(s) image URLs are fetched by
the server, and an out-of-range ``logit_bias`` token or a ``stream_options`` without
``include_usage`` breaks the request (the first one kills the whole process), and an empty
prompt kills the generation thread (the server then fails every request). Errors are OpenAI
shaped: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.

A request that is the only one in flight, greedy and without logit processors decodes through
vqpipe's compiled step (vqpipe/decode/step.py) instead of mlx-lm's batch loop, on the CPU and on
CUDA: 1.3x and 2.1x the tokens/s for one client (docs/serving.md). Requests that overlap are batched
as before.
"""

import argparse
import copy
import functools
import io
import json
import logging
import os
import signal
import sys
import threading
import warnings
import weakref
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.server import (APIHandler, GenerationContext, ModelProvider, Response, ResponseGenerator,
                           _format_top_logprobs)

from ..decode.step import Decoder, capacity_for, default_mode, model_problem, to_kv_caches
from ..decode.stream import text_pieces

MAX_BODY = 16 * 2**20  # bytes; a full context of text is far less
# A lone request whose prompt + max_tokens exceeds this many positions goes to mlx-lm's growing
# cache instead: the compiled step's static cache is allocated whole up front (8B shapes: 1 GB).
COMPILED_MAX_POSITIONS = 8192
DEFAULT_MAX_TOKENS = 512
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class RequestError(Exception):
    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self):
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class ReservoirProvider(ModelProvider):
    """mlx-lm's ModelProvider with vqpipe's loader; it loads the one reservoir given by --model."""

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        import gc

        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from .generate import load_model

        self.reset()
        gc.collect()
        mx.clear_cache()
        model, tokenizer = load_model(model_path)
        if self.cli_args.kv_bits_kivi:
            a = self.cli_args
            model.make_cache = kivi_cache_factory(model, a.kv_bits_kivi, a.kv_group_size_kivi, a.kv_residual,
                                                  a.kv_cache == "packed")
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer = model, tokenizer
        # Batched decoding needs caches that mlx-lm can merge across requests.
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in self.cli_args.served_names:
            raise ValueError(f"model {model_path!r} is not served here")
        return super().load("default_model", None, "default_model")


def kivi_cache_factory(model, bits, group_size, residual, packed=True):
    """A ``model.make_cache`` for mlx-lm: the model's own caches with each plain KVCache made KIVI
    (as vqpipe.kivi.make_kivi_cache, which cannot be used here: it calls model.make_cache).
    ``packed``: PackedKIVICache, with the model's attention routed to it."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from ..kivi import KIVICache, PackedKIVICache
    from ..kivi.attention import packed_problem

    kind = KIVICache
    if packed:
        why = packed_problem(model)  # installs the route
        if why:
            raise ValueError(why)
        kind = PackedKIVICache
    n_layers = len(make_prompt_cache(model))
    own = getattr(model, "make_cache", None)

    def make_cache():
        caches = own() if own else [KVCache() for _ in range(n_layers)]
        return [kind(bits, group_size, residual) if type(c) is KVCache else c for c in caches]

    return make_cache


class Limits:
    """What a request is checked against: the served names, the context, a tokenizer to count with."""

    def __init__(self, args, tokenizer, context, vocab_size):
        self.names = args.served_names
        self.chat_template_args = args.chat_template_args
        self.default_max_tokens = args.max_tokens
        self.tokenizer, self.context, self.vocab_size = tokenizer, context, vocab_size
        self.lock = threading.Lock()  # one tokenizer shared by the handler threads
        self.slots = threading.BoundedSemaphore(args.max_pending)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _check_text_only(messages):
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        parts = content if isinstance(content, list) else []
        if not (content is None or isinstance(content, str) or isinstance(content, list)):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of parts", "messages")
        for part in parts:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(400, f"messages[{i}]: only text content parts are supported", "messages")


def count_prompt(limits, path, body):
    """Prompt tokens, counted as mlx_lm.server will tokenize the request."""
    from mlx_lm.server import convert_chat, process_message_content

    tok = limits.tokenizer
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt must be a string", "prompt")
        with limits.lock:
            return len(tok.encode(prompt))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    _check_text_only(messages)
    messages = copy.deepcopy(messages)
    try:
        with limits.lock:
            if not tok.has_chat_template:
                return len(tok.encode(convert_chat(messages, body.get("role_mapping"))))
            process_message_content(messages)
            kwargs = {**limits.chat_template_args, **(body.get("chat_template_kwargs") or {})}
            return len(tok.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools") or None,
                                               tokenize=True, **kwargs))
    except Exception as e:  # the chat template rejected the messages (roles, order, fields)
        raise RequestError(400, f"messages could not be formatted with the chat template: {e}", "messages")


def _check_options(limits, body):
    if "model" in body and body["model"] not in limits.names:
        raise RequestError(404, f"model {body['model']!r} does not exist; this server has "
                           f"{limits.names[0]!r}", "model", "model_not_found")
    for key in ("adapters", "draft_model"):
        if body.get(key) is not None:
            raise RequestError(400, f"{key} is not supported by vqpipe serve", key)
    if body.get("n") not in (None, 1):
        raise RequestError(400, "n must be 1", "n")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**64):  # what mx.random.seed takes
        raise RequestError(400, f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}", "seed")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise RequestError(400, "stream_options must be an object with a boolean include_usage", "stream_options")
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise RequestError(400, "stop must be a string or a list of strings", "stop")
    bias = body.get("logit_bias")
    if bias is not None:
        ok = isinstance(bias, dict) and all(
            str(k).isdigit() and int(k) < limits.vocab_size and isinstance(v, (int, float)) and -100 <= v <= 100
            for k, v in bias.items())
        if not ok:
            raise RequestError(400, f"logit_bias must map token ids in [0, {limits.vocab_size}) to numbers "
                               "in [-100, 100]", "logit_bias")


def check_request(limits, path, body):
    """The request body as mlx_lm.server should see it, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    _check_options(limits, body)
    body = dict(body, model=limits.names[0])  # one name: mlx-lm starts a new batch on a new name
    if isinstance(body.get("stream_options"), dict):
        body["stream_options"] = {"include_usage": False, **body["stream_options"]}
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is not None and not (_is_int(max_tokens) and 1 <= max_tokens <= limits.context):
        raise RequestError(400, f"{key} must be an integer from 1 to {limits.context} (the context length), "
                           f"got {max_tokens!r}", key)
    n = count_prompt(limits, path, body)
    if n == 0:  # mlx-lm's BatchGenerator raises on it, in the generation thread, which then dies
        raise RequestError(400, "the prompt is empty (no tokens)", "prompt")
    if n >= limits.context:
        raise RequestError(400, f"the prompt has {n} tokens; this model's context is {limits.context} tokens",
                           "messages" if "messages" in body else "prompt", "context_length_exceeded")
    if max_tokens is None:
        body[key] = min(limits.default_max_tokens, limits.context - n)
    elif n + max_tokens > limits.context:
        raise RequestError(400, f"the prompt ({n} tokens) plus {key} ({max_tokens}) exceeds this model's "
                           f"context of {limits.context} tokens", key, "context_length_exceeded")
    return body


class ReservoirHandler(APIHandler):
    """mlx_lm.server's APIHandler; requests are checked first, then handed to it unchanged in form."""

    timeout = 120  # seconds per socket read/write: a client that stops sending frees its thread

    def __init__(self, *args, limits, **kwargs):
        self.limits = limits  # before super().__init__: it handles the request
        super().__init__(*args, **kwargs)

    def handle(self):
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):  # the client left; its generation is stopped
            logging.info("client %s disconnected", self.client_address[0])

    def send_error_json(self, err):
        data = json.dumps(err.body()).encode()
        self.send_response(err.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "a Content-Length header is required")
        if not length.strip().isdigit():
            raise RequestError(400, f"invalid Content-Length {length!r}")
        if int(length) > MAX_BODY:
            raise RequestError(413, f"the request body is over {MAX_BODY} bytes")
        try:
            raw = self.rfile.read(int(length))
        except TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {self.timeout} s") from None
        if len(raw) < int(length):
            raise RequestError(400, f"the body ended after {len(raw)} of {length} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"invalid JSON in the request body: {e}") from None

    def do_POST(self):
        if self.path not in ENDPOINTS:
            return self.send_error_json(RequestError(404, f"no endpoint {self.path}; use one of {ENDPOINTS}"))
        if not self.limits.slots.acquire(blocking=False):
            return self.send_error_json(RequestError(429, "too many requests in flight; retry later"))
        try:
            try:
                body = check_request(self.limits, self.path, self._read_body())
            except RequestError as e:
                return self.send_error_json(e)
            raw = json.dumps(body).encode()
            self.headers.replace_header("Content-Length", str(len(raw)))
            self.rfile = io.BytesIO(raw)  # mlx-lm's do_POST reads the (checked) body again
            super().do_POST()
        finally:
            self.limits.slots.release()

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            return self._json(200, {"object": "list", "data": [self._model()]})
        if self.path.startswith("/v1/models/"):
            name = self.path[len("/v1/models/"):]
            if name in self.limits.names:
                return self._json(200, self._model())
            return self.send_error_json(RequestError(404, f"model {name!r} does not exist", "model", "model_not_found"))
        return super().do_GET()

    def _model(self):
        return {"id": self.limits.names[0], "object": "model", "created": self.created, "owned_by": "vqpipe"}

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def compiled_decode(choice, device=None):
    """Whether a lone request decodes through the compiled step: ``--decode`` compiled or batched,
    or auto: compiled where it measured faster than mlx-lm's batch loop, the CPU (1.30x, SmolLM2
    4-bit) and CUDA (2.14x, a 0.5B shape; docs/serving.md); batched on Metal (not measured)."""
    if choice != "auto":
        return choice == "compiled"
    return default_mode(device) is not None


def greedy_plain(args):
    """Whether mlx-lm's generation arguments ask for greedy decoding with no logit processor: what
    the compiled step computes."""
    s, lg = args.sampling, args.logits
    return (s.temperature == 0 and not lg.logit_bias and lg.repetition_penalty in (None, 0, 1)
            and not lg.presence_penalty and not lg.frequency_penalty)


class _Reader:
    """An iterator over ``responses`` that calls ``done`` once they end."""

    def __init__(self, responses, done):
        self.responses, self.done = responses, done

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.responses)
        except BaseException:
            self.done()
            raise


class ReservoirGenerator(ResponseGenerator):
    """mlx-lm's ResponseGenerator, but a request that is alone in flight, greedy and without
    logit processors decodes through the compiled step (one Decoder, reused while its capacity
    suffices); everything else goes to mlx-lm's loop unchanged. The compiled path starts from
    mlx-lm's prompt cache where it holds a prefix of the prompt and leaves what it wrote there."""

    def __init__(self, provider, prompt_cache, compiled):
        self.compiled = compiled  # before super().__init__ starts the thread
        self._decoder, self._lone = None, None
        # Requests handed in and not yet answered to the end. A request leaves when its last
        # response has been read (before the client has all of it: the next request of a
        # sequential client finds it gone) or when its reader is dropped.
        self._open, self._open_lock = set(), threading.Lock()
        super().__init__(provider, prompt_cache)

    def generate(self, request, generation_args, progress_callback=None):
        key = object()
        with self._open_lock:
            self._open.add(key)
        try:
            ctx, responses = super().generate(request, generation_args, progress_callback)
        except BaseException:
            self._close(key)
            raise
        reader = _Reader(responses, lambda: self._close(key))
        weakref.finalize(reader, self._close, key)
        return ctx, reader

    def _close(self, key):
        with self._open_lock:
            self._open.discard(key)

    def _alone(self):
        with self._open_lock:
            return len(self._open) <= 1

    def _is_batchable(self, args):
        if self.compiled and greedy_plain(args) and self._alone() and self._model_fits():
            self._lone = args  # _serve_single takes this one through the compiled step
            return False
        return super()._is_batchable(args)

    def _model_fits(self):
        if self.model_provider.cli_args.kv_bits_kivi or self.model_provider.draft_model is not None:
            return False
        model = self.model_provider.model
        return model is not None and model_problem(model, "split") is None

    def _serve_single(self, request, stream):
        if request[2] is not self._lone:
            return super()._serve_single(request, stream)
        self._lone = None
        rqueue, body, args = request
        try:
            prompt, _, _, initial_state, _ = self._tokenize(self.model_provider.tokenizer, body, args)
        except Exception as e:
            return rqueue.put(e)
        if len(prompt) + args.max_tokens > COMPILED_MAX_POSITIONS:
            return super()._serve_single(request, stream)
        try:
            with mx.stream(stream):  # the generation thread's stream, as mlx-lm's own paths use it
                self._serve_compiled(rqueue, args, prompt, initial_state)
        except Exception as e:
            rqueue.put(e)

    def _decoder_for(self, positions):
        if self._decoder is None or self._decoder.capacity < positions:
            self._decoder = None  # its buffers go before the new ones are made
            self._decoder = Decoder(self.model_provider.model, capacity_for(positions), "split")
        return self._decoder

    def _serve_compiled(self, rqueue, args, prompt, initial_state):
        tokenizer = self.model_provider.tokenizer
        stop_sequences, text_sm = self._make_state_machine(self.model_provider.model_key, tokenizer,
                                                           args.stop_words)
        ctx = GenerationContext(has_thinking=tokenizer.has_thinking, has_tool_calling=tokenizer.has_tool_calling,
                                tool_parser=tokenizer.tool_parser, text_sm=text_sm,
                                initial_state=initial_state, prompt=prompt, prompt_cache_count=0)
        rqueue.put(ctx)
        decoder = self._decoder_for(len(prompt) + args.max_tokens)
        prefix, rest = self._cached_prefix(prompt)
        ctx.prompt_cache_count = len(prompt) - len(rest)
        logging.info("compiled step: a lone request, %d prompt tokens (%d cached), up to %d new", len(prompt),
                     ctx.prompt_cache_count, args.max_tokens)
        matcher = stop_sequences.matcher()
        generated = []
        ids = decoder.tokens(mx.array(rest), args.max_tokens, logprobs=True, prefix=prefix)
        for piece, token, logprobs, finish in text_pieces(tokenizer, ids, args.max_tokens):
            generated.append(token)
            if matcher.advance(token):
                finish = "stop"
            rqueue.put(Response(piece, token, logprobs[token].item(), finish,
                                _format_top_logprobs(logprobs, args.top_logprobs, tokenizer)))
            if finish is not None or ctx._should_stop:
                break
        rqueue.put(None)
        ids.close()
        self._keep_cache(prompt + generated, decoder)

    def _cached_prefix(self, prompt):
        """(per layer keys and values of the longest cached prefix of ``prompt``, the tokens after
        it) from mlx-lm's prompt cache, or (None, prompt); at least one token is left to feed."""
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.model_provider.model_key, prompt)
        n = len(prompt) - len(rest)
        if cache is None or n == 0 or any(type(c) is not KVCache for c in cache):
            return None, prompt
        n = min(n, len(prompt) - 1)
        if n == 0:
            return None, prompt
        return [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache], prompt[n:]

    def _keep_cache(self, tokens, decoder):
        """The positions the compiled step wrote, as mlx-lm's KVCache, into the prompt cache under
        the tokens they hold (copies: the static buffers are reused by the next request)."""
        n, kv = min(decoder.position, len(tokens)), decoder.kv
        decoder.kv = None
        if kv is None or n < 1:
            return
        self.prompt_cache.insert_cache(self.model_provider.model_key, tokens[:n], to_kv_caches(kv, n))



def context_length(directory, override=None):
    """The model's context (max_position_embeddings), or --context-length where given."""
    config = json.loads((Path(directory) / "config.json").read_text())
    n = override or config.get("max_position_embeddings")
    if not n:
        raise ValueError(f"{directory}/config.json has no max_position_embeddings; give --context-length")
    return int(n), int(config["vocab_size"])


def parse_args(argv):
    from .generate import packed_args_problem

    p = argparse.ArgumentParser(prog="vqpipe serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="reservoir directory (pack stage output)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--name", help="the model id clients use (default: the --model path as given); "
                   "'default_model' and the resolved path are accepted too")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"max_tokens when a request gives none (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--context-length", type=int, help="largest prompt + max_tokens (default: the model's "
                   "max_position_embeddings)")
    p.add_argument("--max-pending", type=int, default=64,
                   help="requests in flight before new ones get 429 (default 64)")
    p.add_argument("--decode-concurrency", type=int, default=32, help="requests decoded in one batch (default 32)")
    p.add_argument("--prompt-concurrency", type=int, default=8, help="prompts prefilled in one batch (default 8)")
    p.add_argument("--prompt-cache-size", type=int, default=10, help="KV caches kept for reuse (default 10)")
    p.add_argument("--decode", choices=("auto", "compiled", "batched"), default="auto",
                   help="a lone greedy request: compiled (vqpipe's compiled step) or batched (mlx-lm's "
                   "batch loop); auto (default): compiled on the CPU and CUDA, batched on Metal (not measured)")
    k = p.add_argument_group("KIVI KV cache (default: mlx-lm's full-precision cache, batched)")
    k.add_argument("--kv-bits", dest="kv_bits_kivi", type=int, choices=(2, 4, 8),
                   help="KIVI at this many bits; requests are then served one at a time (KIVI caches "
                   "cannot be merged into mlx-lm's batches)")
    k.add_argument("--kv-group-size", dest="kv_group_size_kivi", type=int, default=32, metavar="N",
                   help="KIVI group size (default 32)")
    k.add_argument("--kv-residual", type=int, default=128, help="KIVI residual window (default 128)")
    k.add_argument("--kv-cache", choices=("packed", "reference"), default="packed",
                   help="packed (default): the KIVI codes stay packed, attention reading them (the memory "
                   "saving); reference: the quantize-dequantize cache (for comparisons)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.max_pending < 1 or args.decode_concurrency < 1 or args.prompt_concurrency < 1:
        p.error("--max-tokens, --max-pending and the concurrencies must be at least 1")
    if args.kv_group_size_kivi < 1 or args.kv_residual < 0:
        p.error("--kv-group-size must be >= 1 and --kv-residual >= 0")
    why = packed_args_problem(args.kv_bits_kivi, args.kv_group_size_kivi, args.kv_cache == "packed")
    if why:
        p.error(why)
    # The rest of what mlx_lm.server reads from its arguments, at its defaults (no adapters, no
    # draft model, mlx-lm's KV quantization off so requests can be batched).
    fixed = dict(adapter_path=None, draft_model=None, num_draft_tokens=3, trust_remote_code=False,
                 chat_template="", use_default_chat_template=False, temp=0.0, top_p=1.0, top_k=0,
                 min_p=0.0, chat_template_args={}, prefill_step_size=2048, prompt_cache_bytes=None,
                 kv_bits=None, kv_group_size=64, quantized_kv_start=5000, pipeline=False,
                 allowed_origins=["*"])
    for k, v in fixed.items():
        setattr(args, k, v)
    args.served_names = [args.name or args.model, str(Path(args.model).resolve()), "default_model"]
    return args


def _check_port(host, port):
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds
        try:
            s.bind(address)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(args):
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import _run_http_server
    from mlx_lm.utils import load_config, load_tokenizer

    from ..store.reservoir import FILE_NAME

    directory = Path(args.model)
    if not (directory / FILE_NAME).is_file():
        raise ValueError(f"{directory} is not a reservoir directory (no {FILE_NAME})")
    context, vocab = context_length(directory, args.context_length)
    if args.kv_bits_kivi and args.kv_cache == "packed":  # refused before the model loads (a skeleton: no weights)
        from ..kivi.attention import packed_problem
        from ..quant.quantize import skeleton

        why = packed_problem(skeleton(directory))
        if why:
            raise ValueError(why)
    tokenizer = load_tokenizer(directory, eos_token_ids=load_config(directory).get("eos_token_id"))
    handler = functools.partial(ReservoirHandler, limits=Limits(args, tokenizer, context, vocab))
    _check_port(args.host, args.port)  # before the generation thread starts loading the model
    generator = ReservoirGenerator(ReservoirProvider(args), LRUPromptCache(args.prompt_cache_size),
                                      compiled_decode(args.decode))
    if args.host not in LOCAL_HOSTS:
        print(f"vqpipe serve: warning: listening on {args.host}, reachable from other machines; "
              "there is no authentication", file=sys.stderr)
    print(f"vqpipe serve: {args.served_names[0]!r} (context {context} tokens) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # mlx-lm warns on every start that its server has only basic security checks. vqpipe serve binds
    # to 127.0.0.1 and warns (above) when it listens elsewhere, the case where that matters.
    warnings.filterwarnings("ignore", message="mlx_lm.server is not recommended for production")
    # mlx-lm stops cleanly on KeyboardInterrupt; make SIGTERM do the same.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _run_http_server(args.host, args.port, generator, handler_class=handler)  # returns once stopped
    except OSError:
        generator.stop_and_join()
        raise
    # The generation thread is joined by now. Exit without running MLX's static destructors: after a
    # stream was used from a second thread they abort ("terminate called without an active
    # exception", status 134), mlx_lm.server alike.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        serve(args)
    except (ValueError, OSError) as e:
        print(f"vqpipe serve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
