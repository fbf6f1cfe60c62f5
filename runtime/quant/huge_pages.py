"""Fresh CPU buffers backed by transparent huge pages.

A dequantized weight is a large buffer written once, right after it is allocated. On CPU the
first write to each 4 KiB page faults into the kernel, and for a buffer of tens of MB those
faults cost as much as the dequantization itself. Asking for 2 MiB pages (`MADV_HUGEPAGE`, what
torch's `THP_MEM_ALLOC_ENABLE` does for every allocation of a process) cuts their number
512-fold. It is advice only: without transparent huge pages, or off Linux, the buffer is an
ordinary one.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Callable

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20


@functools.cache
def _advise_huge() -> Callable[[int, int], int] | None:
    """`madvise(start, length, MADV_HUGEPAGE)` from libc, or None where there is no such thing."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return lambda start, length: madvise(start, length, advice)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """`torch.empty`, with the whole huge pages inside a large CPU buffer advised before first touch.

    Inside a compiled graph the compiler owns allocation, so the buffer is a plain one there.
    """
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if torch.compiler.is_compiling() or tensor.device.type != "cpu":
        return tensor
    nbytes = tensor.nbytes
    advise = _advise_huge() if nbytes >= 2 * HUGE_PAGE else None
    if advise is not None:
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        stop = (tensor.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        advise(start, stop - start)
    return tensor
