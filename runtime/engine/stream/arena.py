"""The host memory a tree's streamed tensors are packed into: each unit's tensors one after another, aligned.

The host tier is packed into pieces (pinned where the compute device copies from it asynchronously), each tensor
becoming a view of one, in the units' order, so that a unit is one range of a piece and one copy. A piece is filled
and its tensors take their views before the next piece is made, so each tensor's own memory is free to go as soon as
it is packed: placing holds at most one piece beyond the host tier, never the host tier twice. torch's pinned
allocator rounds each allocation up to a power of two (pinning tensor by tensor, or the whole tier at once, can take
up to twice its bytes), so a pinned piece is a power of two of at least four of the largest unit: what it leaves
unused is less than one unit in each piece (at most a quarter of it) and at most half of the last one.

Pinned memory is locked out of the system's reach, so this process's pinned memory stays within a pinned budget,
as ComfyUI core's does (`pinned_budget`: 40% of the memory on Windows, elsewhere up to 90% leaving 4 GiB); a host
tier past what is left of it (torch's host allocator says what is pinned: `pinned_now`) is pageable instead, its
copies then waiting for the host, which `pack` returns, a warning says, and the placing's report shows.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ...host_memory import host_memory
from ...sizes import human
from .. import file_tier, protocol
from ..journal import Journal

_log = logging.getLogger("streamwise.offload")

ALIGNMENT = 512
"""Bytes each tensor's start in a piece is aligned to (what CUDA copies run fastest from)."""

PIECE = 256 << 20
"""The bytes of a piece at least (more where four of the largest unit need more, pinned): what placing holds at
most beyond the host tier."""


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def pinned_budget() -> int:
    """The bytes this process's pinned memory may take at most: core's figure (`comfy.model_management`), 40% of
    the memory on Windows, elsewhere the larger of 40% and the lesser of 90% and all but 4 GiB."""
    total = host_memory().total
    if sys.platform == "win32":
        return int(total * 0.40)
    return int(max(total * 0.40, min(total * 0.90, total - 4 * 2**30)))


Slot = tuple[nn.Module, str, Tensor]
"""A tensor to pack and where it is held: its owner and its name there."""


def pack(journal: Journal, groups: Sequence[Sequence[nn.Module]], *, pinned: bool) -> int:
    """Pack the host tensors of each group of owners (a unit's: their direct parameters and buffers that live in
    memory on the CPU, each tensor once, in order) into pieces, a group's tensors together in one piece, each tensor
    a view of it (a Parameter stays the same object); returns the bytes of pieces pinned now (none where `pinned` is
    false, or the pieces would pass the pinned budget and are pageable). Tensors pinned already (the pieces of an
    earlier placing, laid out alike) stay where they are. A failure later in the placing gives each packed tensor
    a copy of its own again (`Journal.move_data`: the journal holds no second copy of the host tier meanwhile)."""
    slots = [_slots(group) for group in groups]
    held = {id(tensor): tensor for group in slots for _, _, tensor in group}
    already = sum(padded(t.nbytes) for t in held.values() if t.is_pinned())
    pieces = _pieces([[slot for slot in group if not slot[2].is_pinned()] for group in slots], pinned)
    total = sum(nbytes for nbytes, _ in pieces)
    if not total:
        return already
    allocated = sum(_allocation(nbytes, pinned) for nbytes, _ in pieces)
    if pinned and (holding := pinned_now() + allocated) > (budget := pinned_budget()):
        _log.warning("the host tier's %s stay pageable: pinned, this process would hold %s of pinned memory, past "
                     "its budget of %s; copies from it wait for the host", human(total), human(holding), human(budget))
        pinned, allocated = False, 0
    views: dict[int, Tensor] = {}
    for nbytes, run in pieces:
        region, offset = host_region(_allocation(nbytes, pinned), pinned), 0
        for owner, name, tensor in run:
            view = views.get(id(tensor))
            if view is None:
                view = views[id(tensor)] = region[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor)
                offset += padded(tensor.nbytes)
            if isinstance(tensor, nn.Parameter):
                if tensor.data_ptr() != view.data_ptr():  # a tied Parameter takes its view once
                    journal.move_data(tensor, view)
            else:
                journal.set_tensor(owner, name, view)
    return already + allocated


def _slots(owners: Sequence[nn.Module]) -> list[Slot]:
    return [(owner, name, tensor) for owner in owners
            for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]
            if tensor is not None and file_tier.in_memory(tensor) and name not in protocol.relocated_names(owner)
            and tensor.device.type == "cpu"]


def _pieces(runs: list[list[Slot]], pinned: bool) -> list[tuple[int, list[Slot]]]:
    """Consecutive groups' tensors gathered into pieces of at most `PIECE` bytes (pinned: the power of two of four
    of the largest group, where that is more), a group never split; each piece's bytes and what it holds. A tensor
    held by several groups is laid out with the first."""
    counted: set[int] = set()
    sizes = []  # the bytes each group lays out: its tensors no group before it holds
    for run in runs:
        new = {id(tensor): tensor for _, _, tensor in run if id(tensor) not in counted}
        sizes.append(sum(padded(tensor.nbytes) for tensor in new.values()))
        counted.update(new)
    largest = max(sizes, default=0)
    limit = max(PIECE, _allocation(4 * largest, True)) if pinned else max(PIECE, largest)
    pieces: list[tuple[int, list[Slot]]] = []
    for run, size in zip(runs, sizes, strict=True):
        if not pieces or pieces[-1][0] + size > limit:
            pieces.append((0, []))
        nbytes, held = pieces[-1]
        pieces[-1] = (nbytes + size, held + run)
    return [(nbytes, held) for nbytes, held in pieces if nbytes]


def _allocation(nbytes: int, pinned: bool) -> int:
    """What a piece of `nbytes` takes: torch's pinned allocator rounds up to a power of two."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes else nbytes


def pinned_now() -> int:
    """Bytes of pinned memory torch's host allocator holds for this process now (0 where it cannot say)."""
    try:
        return int(torch.cuda.host_memory_stats().get("active_bytes.current", 0))
    except (AttributeError, RuntimeError):  # a torch without the statistics, or without CUDA
        return 0


def host_region(nbytes: int, pinned: bool) -> Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
