"""INT8 W8A8 on a GPU in two Triton kernels where torch takes eight: each row of activations quantized in one pass
(its absolute maximum, the scale, the rounded int8 values), then the int8 x int8 -> int32 matmul with both scales
applied as its result is written.

The arithmetic is `int8._w8a8`'s, operation for operation: the row scale max(|x|) / 127 (at least float32's
smallest normal), x / scale rounded to nearest even and clamped to +-127, the exact integer products, then
(sum * row scale) * weight scale in float32, so the output is the torch path's bit for bit where the sums agree
(integers: always). Chosen by `int8.int8_linear` on CUDA only (`triton_support`); the tests run the kernels in
Triton's interpreter on the CPU (`tests/quant/test_integer_triton.py`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .triton_support import available, launched


def w8a8(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor | None:
    """`rows` (M, K, any float dtype) times the int8 weight `q` (N, K) with its float32 row `scale` (N), transposed:
    float32 (M, N); None where Triton does not serve (the caller takes the torch path)."""
    kernels = _kernels()
    if kernels is None:
        return None
    rows = rows.contiguous()
    m, k = rows.shape
    n = q.shape[0]
    quantized = torch.empty(m, k, dtype=torch.int8, device=rows.device)
    row_scale = torch.empty(m, dtype=torch.float32, device=rows.device)
    if not launched("int8 rows", kernels.quantize_rows, (m,), rows, quantized, row_scale, k, BLOCK=1024):
        return None
    out = torch.empty(m, n, dtype=torch.float32, device=rows.device)
    grid = (-(-m // kernels.BLOCK_M), -(-n // kernels.BLOCK_N))
    if not launched("int8 matmul", kernels.matmul, grid, quantized, q.contiguous(), row_scale, scale.float(), out, m,
                    n, k, BLOCK_M=kernels.BLOCK_M, BLOCK_N=kernels.BLOCK_N, BLOCK_K=kernels.BLOCK_K):
        return None
    return out


@functools.cache
def _kernels():
    """The kernels' module, imported at the first call (Triton reads `TRITON_INTERPRET` as a kernel is defined)."""
    if not available():
        return None
    from . import w8a8_triton_kernels

    return w8a8_triton_kernels
