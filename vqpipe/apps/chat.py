"""Chat with a reservoir: ``vqpipe chat --model DIR`` (one line per user turn).

mlx_lm.chat's loop (q quits, r resets, h helps; ``stream_generate`` with a prompt cache kept between
turns) with vqpipe's loader and an optional KIVI cache. Two changes: it reads plain lines, so it
works with stdin piped (end of input quits), and each turn feeds only the tokens the cache does not
hold yet: the whole conversation is re-templated and compared with the cached tokens, and the cache
is trimmed back to the common prefix where the template renders an earlier turn differently (a
system prompt therefore appears once, as the template puts it). Replies go to stdout, the per-turn
figures to stderr.
"""

import argparse
import sys

from .generate import add_model_args, check_args, kv_summary, load_model, make_cache, make_sampler

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

    def __init__(self, model, tokenizer, args):
        self.model, self.tokenizer, self.args = model, tokenizer, args
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
        reply, generated, last = "", [], None
        for last in stream_generate(self.model, self.tokenizer, rest, max_tokens=self.args.max_tokens,
                                    sampler=make_sampler(self.args), prompt_cache=self.cache):
            write(last.text)
            reply += last.text
            generated.append(last.token)
        self.messages.append({"role": "assistant", "content": reply})
        self.seen = (self.seen + rest + generated)[: cache_size(self.cache)]
        return last


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
    return (f"[{response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s, prompt "
            f"{response.prompt_tokens} tokens {response.prompt_tps:.1f} tok/s, peak "
            f"{response.peak_memory:.3f} GB]")


def main(argv=None):
    p = argparse.ArgumentParser(prog="vqpipe chat", description=__doc__.split("\n")[0],
                                epilog=HELP)
    add_model_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    import mlx.core as mx

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
    chat = Conversation(model, tokenizer, args)

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
