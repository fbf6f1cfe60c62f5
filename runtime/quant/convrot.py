"""ConvRot: a group-wise regular Hadamard rotation that spreads outlier channels before quantizing.

Weights are rotated once (W·Hᵀ per group of G input channels) and activations online (X·Hᵀ);
H is orthonormal, so X·Hᵀ·(W·Hᵀ)ᵀ = X·Wᵀ and the product is unchanged while both operands lose
their outliers. H is a Kronecker power of the 4×4 regular Hadamard matrix (constant row sums),
which is why G must be a power of 4.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...schemas.vocabulary import is_power_of_4
from .errors import QuantError

_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))


def check_group_size(group_size: int, in_features: int) -> None:
    if not is_power_of_4(group_size):
        raise QuantError(f"ConvRot group size must be a power of 4, got {group_size}")
    if in_features % group_size:
        raise QuantError(f"ConvRot group size {group_size} does not divide in_features {in_features}")


_MATRICES: dict[tuple[int, torch.device | None, torch.dtype], Tensor] = {}


def hadamard(group_size: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The orthonormal regular Hadamard matrix of order `group_size`, built once per device and dtype."""
    key = (group_size, device, dtype)
    if key not in _MATRICES:
        h4 = torch.tensor(_H4, dtype=torch.float64) / 2
        matrix = h4
        while matrix.shape[0] < group_size:
            matrix = torch.kron(matrix, h4)
        _MATRICES[key] = matrix.to(device=device, dtype=dtype)
    return _MATRICES[key]


def rotate(x: Tensor, group_size: int) -> Tensor:
    """x·Hᵀ over each group of `group_size` channels of the last dimension."""
    shape = x.shape
    grouped = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    h = hadamard(group_size, x.device, x.dtype)
    return (grouped @ h.T).reshape(shape)


# H is symmetric as well as orthonormal, so the rotation is its own inverse.
unrotate = rotate
