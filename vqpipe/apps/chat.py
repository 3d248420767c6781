"""Chat with a reservoir: ``vqpipe chat --model DIR`` (one line per user turn).

mlx_lm.chat's loop (q quits, r resets, h helps; ``stream_generate`` with a prompt cache kept between
turns) with vqpipe's loader and an optional KIVI cache. Two changes: it reads plain lines, so it
works with stdin piped (end of input quits), and each turn feeds only the tokens the cache does not
hold yet: the whole conversation is re-templated and compared with the cached tokens, and the cache
is trimmed back to the common prefix where the template renders an earlier turn differently (a
system prompt therefore appears once, as the template puts it). Replies go to stdout, the per-turn
figures to stderr. Greedy turns with the full-precision cache decode through the compiled step
where generate's ``--compiled auto`` takes it (decode.step.default_mode: the CPU and CUDA), the
conversation's cache carried between turns as its keys and values.
"""

import argparse
import sys
import time
from types import SimpleNamespace

from .generate import add_model_args, auto_compiled, check_args, kv_summary, load_model, make_cache, make_sampler

HELP = "commands: q quit, r reset the conversation, h help"


def cache_size(cache):
    """Tokens held by a prompt cache (layers agree; the first with a size tells)."""
    return next((c.size() for c in cache if hasattr(c, "size")), 0)


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Conversation:
    """The messages so far, the prompt cache and the tokens it holds."""

    def __init__(self, model, tokenizer, args, mode=None):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.mode, self.decoder = mode, None  # the compiled step's mode, or None: mlx-lm's loop
        self.reset()

    def reset(self):
        sp = self.args.system_prompt
        self.messages = [{"role": "system", "content": sp}] if sp is not None else []
        self.cache = make_cache(self.model, self.args)
        self.seen = []  # the tokens the cache holds, in order

    def _rest(self, tokens):
        """The suffix of ``tokens`` to feed, after trimming the cache to their common prefix."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        # Keep at least one token to feed: generation needs a step to produce logits.
        n = min(common_prefix(self.seen, tokens), len(tokens) - 1)
        if n < len(self.seen):
            if not can_trim_prompt_cache(self.cache):
                self.cache, self.seen, n = make_cache(self.model, self.args), [], 0
            else:
                trim_prompt_cache(self.cache, len(self.seen) - n)
                self.seen = self.seen[:n]
        return tokens[n:]

    def turn(self, text, write):
        """Answer one user message, writing the text as it comes; returns the last response."""
        from mlx_lm.generate import stream_generate

        self.messages.append({"role": "user", "content": text})
        tokens = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        rest = self._rest(tokens)
        if self.mode:
            return self._compiled_turn(rest, write)
        reply, generated, last = "", [], None
        for last in stream_generate(self.model, self.tokenizer, rest, max_tokens=self.args.max_tokens,
                                    sampler=make_sampler(self.args), prompt_cache=self.cache):
            write(last.text)
            reply += last.text
            generated.append(last.token)
        self.messages.append({"role": "assistant", "content": reply})
        self.seen = (self.seen + rest + generated)[: cache_size(self.cache)]
        return last

    def _compiled_turn(self, rest, write):
        """The turn through the compiled step, from the cached keys and values; mlx-lm's
        stream_generate output (an EOS ends the text unshown) and figures; the cache afterwards
        holds what the step wrote."""
        import mlx.core as mx

        from ..decode.step import Decoder, capacity_for, to_kv_caches
        from ..decode.stream import text_pieces

        n, max_tokens = len(self.seen), self.args.max_tokens
        if self.decoder is None or self.decoder.capacity < n + len(rest) + max_tokens:
            self.decoder = None
            self.decoder = Decoder(self.model, capacity_for(n + len(rest) + max_tokens), self.mode)
        prefix = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in self.cache] if n else None
        reply, generated = "", []
        t0 = t1 = time.perf_counter()
        steps = ((t, None) for t in self.decoder.tokens(mx.array(rest), max_tokens, prefix=prefix))
        for i, (piece, token, _, _) in enumerate(text_pieces(self.tokenizer, steps, max_tokens)):
            if i == 0:
                t1 = time.perf_counter()
            generated.append(token)
            write(piece)
            reply += piece
        t2 = time.perf_counter()
        self.messages.append({"role": "assistant", "content": reply})
        written = min(self.decoder.position, n + len(rest) + len(generated))
        self.cache = to_kv_caches(self.decoder.kv, written)
        self.decoder.kv = None
        self.seen = (self.seen + rest + generated)[:written]
        return SimpleNamespace(generation_tokens=len(generated), generation_tps=len(generated) / max(t2 - t1, 1e-9),
                               prompt_tokens=len(rest), prompt_tps=len(rest) / max(t1 - t0, 1e-9),
                               peak_memory=mx.get_peak_memory() / 1e9, mode=self.mode)


def read_line(interactive):
    """The next user line, or None at the end of input."""
    try:
        line = input("> ") if interactive else sys.stdin.readline()
    except EOFError:
        return None
    if not interactive and line == "":
        return None
    return line.rstrip("\n")


def figures(response):
    mode = getattr(response, "mode", None)
    return (f"[{response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s, prompt "
            f"{response.prompt_tokens} tokens {response.prompt_tps:.1f} tok/s, peak "
            f"{response.peak_memory:.3f} GB" + (f", compiled step ({mode})" if mode else "") + "]")


def main(argv=None):
    p = argparse.ArgumentParser(prog="vqpipe chat", description=__doc__.split("\n")[0],
                                epilog=HELP)
    add_model_args(p)
    p.add_argument("--compiled", choices=("auto", "split", "whole", "off"), default="auto",
                   help="greedy turns with the full-precision cache through vqpipe.decode.step's compiled "
                   "step: auto (default) where generate takes it (the CPU and CUDA), off: mlx-lm's loop")
    args = p.parse_args(argv)
    check_args(p, args)
    import mlx.core as mx

    mode = {"auto": None, "off": None}.get(args.compiled, args.compiled)
    if args.compiled == "auto":
        mode = auto_compiled(args, mx.default_device())
    elif mode and (args.temp != 0 or args.kv_bits is not None):
        p.error("--compiled decodes greedily with the full-precision cache (no --temp, no --kv-bits)")

    try:
        model, tokenizer = load_model(args.model)
    except ValueError as e:
        print(f"vqpipe chat: error: {e}", file=sys.stderr)
        return 2
    if not tokenizer.has_chat_template:
        print(f"vqpipe chat: error: {args.model} has no chat template", file=sys.stderr)
        return 2
    mx.random.seed(args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"vqpipe chat: {args.model} ({HELP})")
    from ..decode.step import model_problem

    why = model_problem(model, mode) if mode else None
    if why and args.compiled != "auto":
        print(f"vqpipe chat: error: {why}", file=sys.stderr)
        return 2
    if why:  # a model the step does not take: mlx-lm's loop
        mode = None
    chat = Conversation(model, tokenizer, args, mode)

    def write(text):
        sys.stdout.write(text)
        sys.stdout.flush()

    while (line := read_line(interactive)) is not None:
        query = line.strip()
        if query == "q":
            break
        if query == "r":
            chat.reset()
            print("reset", file=sys.stderr)
        elif query == "h":
            print(HELP, file=sys.stderr)
        if query in ("r", "h", ""):
            continue
        response = chat.turn(line, write)
        write("\n")
        if response is not None:
            print(figures(response), file=sys.stderr)
        summary = kv_summary(chat.cache)
        if summary:
            print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
