"""The quantized layers: ``QuantizedLinear`` / ``QuantizedEmbedding`` (``qlinear``), linears that read
one activation computed as one (``fused``) and the rotation signs folded away (``fold``)."""
