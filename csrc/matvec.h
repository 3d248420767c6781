// codebook_matvec: the mat-vec of a vqpipe QuantizedLinear from its rotated input, as one MLX
// primitive that reads the packed codes once (no dense weight).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "primitive.h"

namespace mlx::core {

// x [..., in] (float32/float16/bfloat16), packed uint32 [out, bits * ceil(in / 32)], scales
// float32 [out] (per row, applied to the output) or float16/float32 [out, in / group_size]
// (per group of rotated inputs), codebook float32 [2^bits], bias [out] -> [..., out] in x's dtype.
array codebook_matvec(
    const array& x,
    const array& packed,
    const array& scales,
    const array& codebook,
    int bits,
    int group_size,
    const std::optional<array>& bias,
    StreamOrDevice s = {});

} // namespace mlx::core
