"""ConvRot INT4 weights expanded on a GPU in one Triton kernel: the packed bytes and the group scales read once, the
compute dtype written once (torch takes five passes: split, subtract, widen, scale, cast).

The arithmetic is `int4._rotated_weight`'s then the cast to the compute dtype: float32(q - 8) * scale, rounded to
nearest even into the compute dtype, so the output has the torch path's bits. Chosen by `int4.int4_linear` on CUDA
only (`triton_support`); the tests run the kernel in Triton's interpreter on the CPU
(`tests/quant/test_integer_triton.py`, beside the INT8 kernels).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .triton_support import available, launched


def rotated_weight(packed: Tensor, scale: Tensor, group: int, dtype: torch.dtype) -> Tensor | None:
    """The weight in its rotated basis, (out, in) in `dtype`, from `packed` (out, in / 2: value 2i the low nibble of
    byte i, stored plus 8) and `scale` (out, in / group); None where Triton does not serve."""
    kernels = _kernels()
    if kernels is None:
        return None
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    weight = torch.empty(out_features, in_features, dtype=dtype, device=packed.device)
    grid = (out_features, -(-in_features // kernels.BLOCK))
    ran = launched("convrot int4", kernels.rotated_weight, grid, packed.contiguous(), scale.float().contiguous(),
                   weight, in_features, group, BLOCK=kernels.BLOCK)
    return weight if ran else None


@functools.cache
def _kernels():
    """The kernel's module, imported at the first call (Triton reads `TRITON_INTERPRET` as a kernel is defined)."""
    if not available():
        return None
    from . import int4_triton_kernels

    return int4_triton_kernels
