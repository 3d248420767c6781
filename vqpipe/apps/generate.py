"""Generate text from a reservoir: ``vqpipe generate --model DIR --prompt TEXT``.

The generation loop is mlx-lm's (``mlx_lm.generate``: ``stream_generate`` with its streaming print
and its prompt/generation tokens-per-second and peak-memory lines); vqpipe adds the reservoir loader
and the KIVI KV cache. ``--kv-bits`` selects KIVI (vqpipe.kivi), not mlx-lm's own quantized cache,
with its codes packed and attention reading them (the memory saving; ``--kv-cache reference`` is
the quantize-dequantize reference cache, full precision resident, kept for comparisons).
On the CPU and on CUDA, greedy decoding with the full-precision cache runs the compiled split step
(vqpipe.decode.step, docs/decode.md), where it measured faster than the eager loop; ``--compiled``
picks another mode.
The argument helpers here are shared with ``vqpipe chat``.
"""

import argparse
import sys
from pathlib import Path

DEFAULT_MAX_TOKENS = 100


def add_model_args(p):
    """--model, the sampling options and the KIVI options (shared by generate and chat)."""
    p.add_argument("--model", required=True, help="reservoir directory (pack stage output)")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p (default 1)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    p.add_argument("--system-prompt", help="system message for the chat template")
    k = p.add_argument_group("KIVI KV cache (default: mlx-lm's full-precision cache)")
    k.add_argument("--kv-bits", type=int, choices=(2, 4, 8),
                   help="quantize the KV cache with KIVI at this many bits")
    k.add_argument("--kv-cache", choices=("packed", "reference"), default="packed",
                   help="packed (default): the KIVI codes stay packed, attention reading them (the memory "
                   "saving); reference: the quantize-dequantize cache, full precision resident (for comparisons)")
    k.add_argument("--kv-group-size", type=int, default=32, help="KIVI group size (default 32)")
    k.add_argument("--kv-residual", type=int, default=128,
                   help="KIVI full-precision residual window in tokens (default 128)")
    k.add_argument("--kv-kernels", choices=("auto", "on", "off"), default="auto",
                   help="KIVI fused kernels: auto (where the backend has them), on, off (MLX ops)")


def check_args(p, args):
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.kv_group_size < 1 or args.kv_residual < 0:
        p.error("--kv-group-size must be >= 1 and --kv-residual >= 0")
    why = packed_args_problem(args.kv_bits, args.kv_group_size, args.kv_cache == "packed")
    if why:
        p.error(why)
    if not (0.0 <= args.top_p <= 1.0) or args.temp < 0:
        p.error("--temp must be >= 0 and --top-p in [0, 1]")


def packed_args_problem(bits, group_size, packed):
    """Why the packed KIVI cache cannot be used with these settings (a sentence), or None."""
    if not packed or bits is None:
        return None
    if group_size % (32 // bits):
        return (f"--kv-group-size {group_size} is not a multiple of {32 // bits}: the packed KIVI cache packs "
                f"{bits}-bit codes {32 // bits} to a 32-bit word (or use --kv-cache reference)")
    return None


def load_model(path):
    """``vqpipe.load`` with a one-line error for a path that is not a reservoir directory."""
    import vqpipe
    from ..store.reservoir import FILE_NAME

    path = Path(path)
    if not (path / FILE_NAME).is_file():
        raise ValueError(f"{path} is not a reservoir directory (no {FILE_NAME}); "
                         "give a pack stage output such as results/reservoir/MODEL/VARIANT/persist-off")
    return vqpipe.load(path)


def make_cache(model, args):
    """A KIVI prompt cache when --kv-bits is given (packed unless --kv-cache reference), else mlx-lm's default one."""
    from mlx_lm.models.cache import make_prompt_cache

    if args.kv_bits is None:
        return make_prompt_cache(model)
    from ..kivi import make_kivi_cache

    kernels = {"auto": None, "on": True, "off": False}[args.kv_kernels]
    return make_kivi_cache(model, args.kv_bits, args.kv_group_size, args.kv_residual, kernels,
                           packed=args.kv_cache == "packed")


def make_sampler(args):
    from mlx_lm.sample_utils import make_sampler as mlx_sampler

    return mlx_sampler(args.temp, args.top_p)


def kv_summary(cache):
    """One line on a KIVI cache's tokens and sizes, or None for a plain cache."""
    from ..kivi import cache_stats

    s = cache_stats(cache)
    if not s:
        return None
    mib = 2**20
    return (f"KV cache (KIVI): {s['offset']} tokens, {s['quantized_tokens']} quantized; "
            f"{s['compressed_nbytes'] / mib:.2f} MiB packed vs {s['uncompressed_nbytes'] / mib:.2f} MiB "
            f"unquantized ({s['resident_nbytes'] / mib:.2f} MiB resident)")


def encode_prompt(tokenizer, text, use_template, system_prompt=None):
    """Token ids for one user turn, templated as mlx_lm.generate does."""
    if not use_template:
        return tokenizer.encode(text)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": text})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=False)


def compiled_generate(model, tokenizer, prompt, max_tokens, mode, cache=None):
    """Stream greedy text through decode_step (``cache`` None) or, over a packed KIVI ``cache``,
    vqpipe.kivi.compiled, stopping at an EOS token; mlx-lm's summary lines."""
    import time

    import mlx.core as mx
    from ..decode.step import Decoder
    from ..decode.stream import text_pieces

    if cache is None:
        ids = Decoder(model, len(prompt) + max_tokens, mode).tokens(mx.array(prompt), max_tokens)
    else:
        from ..kivi.compiled import stream

        ids, mode = stream(model, cache, prompt, max_tokens), f"{mode}, packed KIVI-{cache[0].kv_bits}"
    n = 0
    print("=" * 10)
    t0 = time.perf_counter()
    for i, (piece, tok, _, _) in enumerate(text_pieces(tokenizer, ((t, None) for t in ids), max_tokens)):
        if i == 0:
            t1 = time.perf_counter()
        n += tok not in tokenizer.eos_token_ids
        print(piece, end="", flush=True)
    t2 = time.perf_counter()
    print()
    print("=" * 10)
    print(f"Prompt: {len(prompt)} tokens, {len(prompt) / (t1 - t0):.3f} tokens-per-sec")
    print(f"Generation: {n} tokens, {n / max(t2 - t1, 1e-9):.3f} tokens-per-sec (compiled step, {mode})")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    return 0


def auto_compiled(args, device):
    """The decode path ``--compiled auto`` takes: for greedy decoding with the full-precision cache
    decode.step.default_mode (the split compiled step on the CPU and CUDA, where it measured faster
    than the eager loop; main falls back to the eager loop for a model it does not take,
    decode.step.model_problem), else None (the eager loop: sampling and the KIVI caches)."""
    from ..decode.step import default_mode

    mode = default_mode(device)
    return mode if mode and args.temp == 0 and args.kv_bits is None else None


def main(argv=None):
    p = argparse.ArgumentParser(prog="vqpipe generate", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt ('-' reads it from stdin)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template (default: when the tokenizer has one)")
    p.add_argument("--compiled", choices=("auto", "whole", "split", "off"), default="auto",
                   help="greedy decode through vqpipe.decode.step's compiled step (docs/decode.md): auto (default) "
                   "takes split on CUDA for greedy decoding with the full-precision cache and the eager loop "
                   "elsewhere; whole with --kv-bits: vqpipe.kivi.compiled's step over the packed KIVI cache "
                   "(docs/kivi.md); off: mlx-lm's eager loop")
    args = p.parse_args(argv)
    check_args(p, args)
    import mlx.core as mx

    auto = args.compiled == "auto"
    if auto:
        args.compiled = auto_compiled(args, mx.default_device())
    elif args.compiled == "off":
        args.compiled = None
    kivi_ok = args.kv_cache == "packed" and args.compiled == "whole"
    if args.compiled and (args.temp != 0 or (args.kv_bits is not None and not kivi_ok)):
        p.error("--compiled decodes greedily with the full-precision cache, or in mode whole with "
                "--kv-bits N (packed cache): no --temp, no --kv-cache reference")
    from mlx_lm import generate

    try:
        model, tokenizer = load_model(args.model)
    except ValueError as e:
        print(f"vqpipe generate: error: {e}", file=sys.stderr)
        return 2
    if auto and args.compiled:  # a model the compiled step does not take decodes in mlx-lm's loop
        from ..decode.step import model_problem

        if model_problem(model, args.compiled):
            args.compiled = None
    use_template = tokenizer.has_chat_template if args.chat_template is None else args.chat_template
    if use_template and not tokenizer.has_chat_template:
        print(f"vqpipe generate: error: {args.model} has no chat template; use --no-chat-template",
              file=sys.stderr)
        return 2
    mx.random.seed(args.seed)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n")
    prompt = encode_prompt(tokenizer, text, use_template, args.system_prompt)
    try:
        if args.compiled and args.kv_bits is None:
            return compiled_generate(model, tokenizer, prompt, args.max_tokens, args.compiled)
        cache = make_cache(model, args)
    except ValueError as e:  # a model the compiled step or the packed KIVI cache does not take
        print(f"vqpipe generate: error: {e}", file=sys.stderr)
        return 2
    if args.compiled:
        compiled_generate(model, tokenizer, prompt, args.max_tokens, args.compiled, cache)
        print(kv_summary(cache))
        return 0
    generate(model, tokenizer, prompt, verbose=True, max_tokens=args.max_tokens,
             sampler=make_sampler(args), prompt_cache=cache)
    line = kv_summary(cache)
    if line:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
