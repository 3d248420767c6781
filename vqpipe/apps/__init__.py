"""Using a reservoir: ``vqpipe generate``, ``vqpipe chat`` and ``vqpipe serve`` (mlx-lm's loops)."""
