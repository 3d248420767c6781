"""A weight matrix as codes: seeded rotations, Lloyd-Max codebooks, bit packing, GPTQ error
feedback and per-layer widths. Arrays in, arrays out; no layers, no models."""
