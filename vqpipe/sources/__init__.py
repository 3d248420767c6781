"""Where models come from: synthetic models (``synth``) and GGUF files (``gguf``, ``gguf_check``,
``gguf_tokenizer``), each turned into a Hugging Face layout directory."""
