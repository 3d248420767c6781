"""Decoding: a compiled single-token step over a static KV cache (``step``)."""
