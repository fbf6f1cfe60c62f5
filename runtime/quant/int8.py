"""INT8 weights: symmetric, one fp32 scale per output row, optionally ConvRot-rotated.

The matmul takes the fastest exact-enough path the device offers: W8A8 through `torch._int_mm`
where its shape rules hold (CUDA: more than 16 rows, K and N multiples of 8), W8A16 through
`torch._weight_int8pack_mm` on the CPU (bf16 activations, int8 weights), and dequantize-then-
matmul anywhere else (also on the CPU when in_features is not a multiple of 16, where torch's
packed kernel crashes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .convrot import rotate, unrotate

QMAX = 127


def quantize_int8(weight: Tensor, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """(int8 [out, in], fp32 scale [out]) for a float weight, rotated first when `group_size` is set."""
    w = weight.float()
    if group_size:
        w = rotate(w, group_size)
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, group_size: int | None, dtype: torch.dtype) -> Tensor:
    """The float weight in the original (unrotated) basis."""
    w = q.float() * scale.float()[:, None]
    if group_size:
        w = unrotate(w, group_size)
    return w.to(dtype)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, group_size: int | None) -> Tensor:
    if group_size:
        x = rotate(x, group_size)
    rows = x.reshape(-1, x.shape[-1])
    out_features, in_features = q.shape
    if rows.is_cuda and rows.shape[0] > 16 and in_features % 8 == 0 and out_features % 8 == 0:
        out = _w8a8(rows, q, scale)
    elif rows.device.type == "cpu" and in_features % 16 == 0:  # the packed kernel crashes on other K
        compute = rows.dtype if rows.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        out = torch._weight_int8pack_mm(rows.to(compute), q, scale.to(compute))
    else:
        out = F.linear(rows, q.to(rows.dtype) * scale.to(rows.dtype)[:, None])
    out = out.to(x.dtype).reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias.to(x.dtype)


def _w8a8(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """Dynamic per-row activation quantization, an int8×int8→int32 GEMM, then both scales."""
    x_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    xq = torch.round(rows.float() / x_scale).clamp(-QMAX, QMAX).to(torch.int8)
    return torch._int_mm(xq, q.t()).float() * x_scale * scale.float()[None, :]
