"""The Triton kernel of `int4_triton` (imported only where Triton is available, and only once asked for)."""

from __future__ import annotations

import triton
import triton.language as tl

from .gguf_triton_kernels import cast

BLOCK = 1024
"""Values of one output row a program writes."""


@triton.jit
def rotated_weight(packed, scales, out, in_features, group, BLOCK: tl.constexpr):
    """Row `program_id(0)` of the weight, values `program_id(1) * BLOCK` on: float32(nibble - 8) * its group's scale,
    rounded to the output's dtype to nearest, ties to even."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = j < in_features
    byte = tl.load(packed + row * (in_features // 2) + j // 2, mask=inside, other=0)
    q = ((byte >> (4 * (j % 2))) & 0x0F).to(tl.int32) - 8
    scale = tl.load(scales + row * (in_features // group) + j // group, mask=inside, other=0.0)
    tl.store(out + row * in_features + j, cast(q.to(tl.float32) * scale, out), mask=inside)
