"""Text from a stream of greedy token ids, as mlx-lm's ``stream_generate`` makes it: each id's new
text from the tokenizer's streaming detokenizer; an EOS id ends the text without being shown
(finish "stop"), the last of ``max_tokens`` ids is shown and ends it ("length"). generate, chat and
serve read the compiled step's ids through it (vqpipe/decode/step.py ``Decoder.tokens``)."""


def text_pieces(tokenizer, steps, max_tokens):
    """``(text, id, logprobs, finish)`` per ``(id, logprobs)`` of ``steps``; finish None until the last."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for n, (token, logprobs) in enumerate(steps):
        finish = None
        if token in tokenizer.eos_token_ids:
            finish = "stop"
        else:
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                finish = "length"
        if finish is not None:
            detokenizer.finalize()
        yield detokenizer.last_segment, token, logprobs, finish
        if finish is not None:
            return
