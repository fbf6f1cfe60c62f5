"""ConvRot INT4 weights: rotated like ConvRot INT8, symmetric 4-bit values packed two per byte,
one fp32 scale per row and group of `scale_group` input channels.

Compute is W4A16 (unpack, dequantize, matmul on rotated activations), enough on the CPU; on CUDA the rotated weight
is expanded in one Triton kernel where Triton serves (`int4_triton`). These residents are not
compile-safe: torch has no fake kernels for their packing, so the compile engine refuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..engine.tracing import plain_call
from . import int4_triton
from .convrot import rotate, unrotate

QMAX = 7
SCALE_GROUP = 64


def scale_group_for(group_size: int) -> int:
    """Scale groups of 64 channels, or the rotation group when that is smaller (both divide in_features)."""
    return min(SCALE_GROUP, group_size)


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(uint8 [out, in/2] with two values a byte, fp32 scale [out, in/scale_group])."""
    w = rotate(weight.float(), group_size)
    out_features, in_features = w.shape
    grouped = w.reshape(out_features, -1, scale_group_for(group_size))
    scale = grouped.abs().amax(dim=2).clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    q = torch.round(grouped / scale[..., None]).clamp(-QMAX, QMAX).to(torch.int16) + 8  # 1..15
    q = q.reshape(out_features, in_features // 2, 2)
    packed = (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8)
    return packed, scale


def dequantize_int4(packed: Tensor, scale: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    return unrotate(_rotated_weight(packed, scale, group_size), group_size).to(dtype)


def int4_linear(x: Tensor, packed: Tensor, scale: Tensor, bias: Tensor | None, group_size: int) -> Tensor:
    """x·Wᵀ as rotate(x)·W_rotᵀ: rotating the activations costs rows·in·group, unrotating the weight out·in·group.
    On CUDA the rotated weight is expanded in one Triton kernel where Triton serves (`int4_triton`, the same bits)."""
    weight = None
    if packed.is_cuda and plain_call(x):
        weight = int4_triton.rotated_weight(packed, scale, scale_group_for(group_size), x.dtype)
    if weight is None:
        weight = _rotated_weight(packed, scale, group_size).to(x.dtype)
    return F.linear(rotate(x, group_size), weight, None if bias is None else bias.to(x.dtype))


def _rotated_weight(packed: Tensor, scale: Tensor, group_size: int) -> Tensor:
    """The float32 weight in the rotated basis it was quantized in."""
    out_features = packed.shape[0]
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(torch.int8) - 8  # 1..15 as stored
    grouped = q.reshape(out_features, -1, scale_group_for(group_size)).float() * scale.float()[..., None]
    return grouped.reshape(out_features, -1)
