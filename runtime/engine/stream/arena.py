"""The host region a tree's streamed tensors are packed into: each unit's tensors one after another, aligned.

One region holds the host tier (pinned where the compute device copies from it asynchronously: torch's pinned
allocator rounds each allocation up to a power of two, so pinning tensor by tensor can take up to twice the host
budget), each tensor becoming a view of it, in the units' order, so that a unit is one range of it and one copy.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import file_tier, protocol
from ..journal import Journal

ALIGNMENT = 512
"""Bytes each tensor's start in the region is aligned to (what CUDA copies run fastest from)."""


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def pack(journal: Journal, owners: list[nn.Module], *, pinned: bool) -> None:
    """Pack the host tensors of `owners` (their direct parameters and buffers that live in memory on the CPU, each
    once, in order) into one region, each a view of it (a Parameter stays the same object). Tensors pinned already
    (the region of an earlier placing, laid out alike) stay where they are."""
    slots = [(owner, name, tensor) for owner in owners
             for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]
             if tensor is not None and file_tier.in_memory(tensor) and name not in protocol.relocated_names(owner)
             and tensor.device.type == "cpu" and not tensor.is_pinned()]
    offsets, total = {}, 0
    for _, _, tensor in slots:
        if id(tensor) not in offsets:
            offsets[id(tensor)] = total
            total += padded(tensor.nbytes)
    if not total:
        return
    region, views = host_region(total, pinned), {}
    for owner, name, tensor in slots:
        view = views.get(id(tensor))
        if view is None:
            start = offsets[id(tensor)]
            view = views[id(tensor)] = region[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
        if isinstance(tensor, nn.Parameter):
            if tensor.data_ptr() != view.data_ptr():  # a tied Parameter takes its view once
                journal.set_data(tensor, view)
        else:
            journal.set_tensor(owner, name, view)


def host_region(nbytes: int, pinned: bool) -> Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
