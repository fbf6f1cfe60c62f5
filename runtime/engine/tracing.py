"""Whether a call runs as plain eager code: what decides if a fast route may be taken as native code or as Python
torch never records."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode


def plain_call(x: Tensor) -> bool:
    """Whether a computation on `x` here is seen by nothing but its caller: no compiled graph or other tracer (a
    dispatch mode) records it, and no gradient is asked of it. Else only operators torch knows serve."""
    return not (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
                or (x.requires_grad and torch.is_grad_enabled()))
