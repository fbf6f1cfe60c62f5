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


def compiled_call(x: Tensor) -> bool:
    """Whether a computation on `x` is being traced into a compiled graph and no gradient is asked of it: where an
    operator of ours with a meta (no autograd) runs inside the graph as the eager call's kernel would."""
    return torch.compiler.is_compiling() and not (x.requires_grad and torch.is_grad_enabled())
