"""Half-precision Linear layers on the CPU, fed several rows at once, multiplied in float32 a slab of weight rows at a
time.

Where the CPU has no half-precision dot products of its own (x86 before AVX512-BF16 or AMX, which is most desktops),
torch multiplies a float16 or bfloat16 matrix one input row after another: 27 ms for 32 rows of a 2048 → 5632 layer
on 2 threads, 27 times its 1 ms for one row, while llama.cpp takes 5 ms. Its float32 GEMM is blocked for the cache:
widening a slab of weight rows (`SLAB_BYTES`, cache-sized, so the float32 copy never leaves the cache and never
needs the budget's room) and multiplying it takes 7 ms for the same 32 rows, 76-86 ms for 512 (llama.cpp's F16: 83).

The arithmetic is torch's own: every float16 and bfloat16 value is a float32 value, so the products are exact, the
sums float32, and each output is rounded into the layer's dtype once (the bias added before that rounding). Only
the order of the float32 sums differs from torch's half-precision kernel, so an output may differ from it in its
last bit; against `F.linear` in float32 on the same values both are within the output's rounding (`docs/`).

A single row (decode) stays in the layer's dtype: there torch's kernel reads the weight once at memory speed, as
llama.cpp's does, and widening would only add work. Compiled graphs, other tracers and gradients see `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .tracing import plain_call

ARITHMETIC = "float32"
"""What a load marks the half-precision Linear leaves it fills with (`protocol.ARITHMETIC`): they may widen. Trees
converted in place are not marked, and compute as their originals do, bit for bit."""
HALF_TYPES = {torch.float16: "F16", torch.bfloat16: "BF16"}
"""The dtypes widened where the CPU lacks kernels for them, by their names in a load report."""
ROWS = 4
"""The fewest input rows widened: below, torch's own half-precision kernel is as fast (measured at 2 threads)."""
SLAB_BYTES = 4 << 20
"""The float32 weight rows widened at once: within a cache, yet enough rows for the GEMM's blocking."""


def _native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices in hardware, where torch's own kernel is the fast one."""
    probe = {torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
             torch.float16: ("_is_amx_fp16_supported",)}[dtype]  # private, so looked up: absent means no
    return any(getattr(torch.cpu, name, lambda: False)() for name in probe)


_WIDENED = {dtype for dtype in HALF_TYPES if not _native(dtype)}
"""The dtypes widened on this CPU."""


def widens(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether `linear` computes `x · weightᵀ` by widening: a half-precision weight on a CPU without native kernels
    for it, the input in its dtype, at least `ROWS` rows, in plain eager code asking no gradient (`no_grad` or
    `inference_mode`, as `generate` runs)."""
    return (weight.dtype in _WIDENED and x.dtype == weight.dtype and x.device.type == "cpu"
            and x.numel() >= ROWS * weight.shape[1] and plain_call(x)
            and not (torch.is_grad_enabled() and (weight.requires_grad or getattr(bias, "requires_grad", False))))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)` with float32 products and sums, rounded once into x's dtype."""
    if not widens(x, weight, bias):
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    columns = x.reshape(-1, in_features).float().t()
    slab_rows = max(1, SLAB_BYTES // (4 * in_features))
    slab = torch.empty(min(slab_rows, out_features), in_features)
    transposed = torch.empty(out_features, columns.shape[1])  # (out, rows): each slab's result is contiguous
    for first in range(0, out_features, slab_rows):
        last = min(first + slab_rows, out_features)
        torch.mm(slab[: last - first].copy_(weight[first:last]), columns, out=transposed[first:last])
    if bias is not None:
        transposed += bias.float()[:, None]
    out = torch.empty(columns.shape[1], out_features, dtype=x.dtype).copy_(transposed.t())
    return out.reshape(*x.shape[:-1], out_features)
