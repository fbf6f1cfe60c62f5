"""The Triton kernels of `w8a8_triton` (imported only where Triton is available, and only once asked for)."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64
"""The matmul's tile: rows, output features, and the reduction step (int8 tensor-core shapes)."""


@triton.jit
def rint(values):
    """Round to the nearest integer, ties to even (as `torch.round`), exactly: the fraction below the floor is exact
    for the magnitudes here (under 2^23)."""
    below = tl.floor(values)
    fraction = values - below
    odd = (below - 2.0 * tl.floor(below * 0.5)) != 0.0
    up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    return tl.where(up, below + 1.0, below)


@triton.jit
def quantize_rows(x, out, scales, k, BLOCK: tl.constexpr):
    """Row `program_id` of `x` as int8: scale = max(max |x|, float32's smallest normal) / 127, then round(x / scale)
    clamped to +-127, the division correctly rounded (`div_rn`: a GPU's `/` is approximate by default)."""
    row = tl.program_id(0).to(tl.int64)
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, k, BLOCK):
        j = start + tl.arange(0, BLOCK)
        values = tl.load(x + row * k + j, mask=j < k, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(values))
    scale = tl.div_rn(tl.maximum(tl.max(largest, axis=0), 1.1754943508222875e-38), 127.0)
    tl.store(scales + row, scale)
    for start in range(0, k, BLOCK):
        j = start + tl.arange(0, BLOCK)
        values = tl.load(x + row * k + j, mask=j < k, other=0.0).to(tl.float32)
        quantized = tl.minimum(tl.maximum(rint(tl.div_rn(values, scale)), -127.0), 127.0)
        tl.store(out + row * k + j, quantized.to(tl.int8), mask=j < k)


@triton.jit
def matmul(xq, wq, x_scales, w_scales, out, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """out (m, n) float32 = (xq (m, k) int8 . wq (n, k) int8 transposed, summed exactly in int32) * row scale *
    weight scale, left to right."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for start in range(0, k, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        a = tl.load(xq + rows[:, None].to(tl.int64) * k + j[None, :], mask=(rows[:, None] < m) & (j[None, :] < k),
                    other=0)
        b = tl.load(wq + cols[None, :].to(tl.int64) * k + j[:, None], mask=(cols[None, :] < n) & (j[:, None] < k),
                    other=0)
        total += tl.dot(a, b)
    x_scale = tl.load(x_scales + rows, mask=rows < m, other=0.0)
    w_scale = tl.load(w_scales + cols, mask=cols < n, other=0.0)
    result = total.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    inside = (rows[:, None] < m) & (cols[None, :] < n)
    tl.store(out + rows[:, None].to(tl.int64) * n + cols[None, :], result, mask=inside)
