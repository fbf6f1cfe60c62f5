"""The host region a tree's streamed tensors are packed into: each unit's tensors one after another, aligned.

One region holds the host tier (pinned where the compute device copies from it asynchronously: torch's pinned
allocator rounds each allocation up to a power of two, so pinning tensor by tensor can take up to twice the host
budget), each tensor becoming a view of it, in the units' order, so that a unit is one range of it and one copy.

Pinned memory is locked out of the system's reach, so this process's pinned memory stays within a pinned budget,
as ComfyUI core's does (`pinned_budget`: 40% of the memory on Windows, elsewhere up to 90% leaving 4 GiB); a region
past what is left of it (torch's host allocator says what is pinned: `pinned_now`) is pageable instead, its copies
then waiting for the host, which `pack` returns, a warning says, and the placing's report shows.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import Tensor, nn

from ...host_memory import host_memory
from ...sizes import human
from .. import file_tier, protocol
from ..journal import Journal

_log = logging.getLogger("streamwise.offload")

ALIGNMENT = 512
"""Bytes each tensor's start in the region is aligned to (what CUDA copies run fastest from)."""


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def pinned_budget() -> int:
    """The bytes this process's regions may pin at most: core's figure (`comfy.model_management`), 40% of the
    memory on Windows, elsewhere the larger of 40% and the lesser of 90% and all but 4 GiB."""
    total = host_memory().total
    if sys.platform == "win32":
        return int(total * 0.40)
    return int(max(total * 0.40, min(total * 0.90, total - 4 * 2**30)))


def pack(journal: Journal, owners: list[nn.Module], *, pinned: bool) -> int:
    """Pack the host tensors of `owners` (their direct parameters and buffers that live in memory on the CPU, each
    once, in order) into one region, each a view of it (a Parameter stays the same object); returns the bytes of
    them pinned now (none where `pinned` is false, or the region would pass the pinned budget and is pageable).
    Tensors pinned already (the region of an earlier placing, laid out alike) stay where they are."""
    candidates = [(owner, name, tensor) for owner in owners
                  for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]
                  if tensor is not None and file_tier.in_memory(tensor) and name not in protocol.relocated_names(owner)
                  and tensor.device.type == "cpu"]
    already = sum(padded(t.nbytes) for t in {id(t): t for _, _, t in candidates if t.is_pinned()}.values())
    slots = [slot for slot in candidates if not slot[2].is_pinned()]
    offsets, total = {}, 0
    for _, _, tensor in slots:
        if id(tensor) not in offsets:
            offsets[id(tensor)] = total
            total += padded(tensor.nbytes)
    if not total:
        return already
    if pinned and (holding := pinned_now() + total) > (budget := pinned_budget()):
        _log.warning("the host tier's %s stay pageable: pinned, this process would hold %s of pinned memory, past "
                     "its budget of %s; copies from it wait for the host", human(total), human(holding), human(budget))
        pinned = False
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
    return already + (total if pinned else 0)


def pinned_now() -> int:
    """Bytes of pinned memory torch's host allocator holds for this process now (0 where it cannot say)."""
    try:
        return int(torch.cuda.host_memory_stats().get("active_bytes.current", 0))
    except (AttributeError, RuntimeError):  # a torch without the statistics, or without CUDA
        return 0


def host_region(nbytes: int, pinned: bool) -> Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
