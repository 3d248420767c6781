"""Calibration text the source model writes itself: calibration for any model, offline.

A few fixed seed requests, in the model's chat format when its tokenizer has a template, are
answered by the model with temperature sampling (mlx-lm's batch generation, one batch; the
sampling key seeded: the same tokens on the same machine and software). The prompts and
answers, concatenated in order, are cut into windows of the calibration length.
"""

import mlx.core as mx

SEEDS = (
    "Tell me a story about a lighthouse keeper and a storm.",
    "Explain how a steam engine works, step by step.",
    "Write a letter to a friend about a trip to the mountains.",
    "What are the causes of the seasons on Earth?",
    "Describe a busy market in an old city.",
    "Give me advice on learning to play the piano.",
    "Summarize the history of the printing press.",
    "Write a short essay on why people keep diaries.",
)
TEMPERATURE = 0.8


def prompt_ids(tokenizer, request):
    """Token ids of one seed request: the chat template's user turn if the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True))
    return list(tokenizer.encode(request))


def self_tokens(model, tokenizer, windows, length, seed=0, temperature=TEMPERATURE, progress=None):
    """[windows, length] int32: ``windows`` windows of ``length`` tokens of text ``model`` writes.

    One answer per window (seed requests in turn), up to ``length`` tokens each; rounds repeat
    with the next key until the concatenation fills every window."""
    if windows < 1 or length < 2:
        raise ValueError(f"self-generated calibration needs at least 1 window of 2 tokens, got {windows} x {length}")
    from mlx.utils import tree_flatten

    kept = tree_flatten(model.parameters())
    model.set_dtype(mx.float32)  # bf16 on the CPU is ~10x slower (the stored arrays come back after)
    try:
        stream = _generate(model, tokenizer, windows, length, seed, temperature, progress)
    finally:
        model.load_weights(kept, strict=False)
    return mx.array(stream[: windows * length], dtype=mx.int32).reshape(windows, length)


def _generate(model, tokenizer, windows, length, seed, temperature, progress):
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    stream, round_ = [], 0
    while len(stream) < windows * length:
        mx.random.seed(seed * 1000 + round_)
        prompts = [prompt_ids(tokenizer, SEEDS[(i + round_) % len(SEEDS)]) for i in range(windows)]
        out = batch_generate(model, tokenizer, prompts, max_tokens=length, sampler=make_sampler(temperature),
                             return_token_ids=True)
        for p, ids in zip(prompts, out.token_ids):
            stream.extend(p + list(ids))
        round_ += 1
        if progress:
            progress(f"[self-generated] round {round_}: {len(stream)} of {windows * length} tokens")
    return stream


def provenance(tokenizer, temperature=TEMPERATURE):
    return {"seeds": list(SEEDS), "temperature": temperature,
            "chat_template": bool(getattr(tokenizer, "chat_template", None))}
