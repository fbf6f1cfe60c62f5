"""A leased mapping whose file was cut under it reads as zeros instead of killing the process with SIGBUS.

A read lease holds every writer until the lease watcher has copied the mapped bytes (`leased`), but two things get
past it: the kernel's break time running out while the watcher cannot run (the process stopped, or its own thread
holding the interpreter's lock while it writes the file), after which a truncation goes through, and the next touch
of a page past the file's new end is a SIGBUS, which ends the process. This module installs a handler for SIGBUS
(`sigaction`, through ctypes) that looks the faulting address up among the leased regions: inside one, the region is
replaced by anonymous zero pages at the same address (`mmap` with `MAP_FIXED`), the lease is marked lost, and the
faulting read goes on, reading zeros; the model's next check raises a `CheckpointError` (`leased.check_leases`), so
no number computed from them is returned. A fault anywhere else goes to the handler that was there before (the
default ends the process, as it would have), which is put back for it.

The handler is Python run by ctypes on the faulting thread (it takes the interpreter's lock, which torch's kernels do
not hold while they read weights); it is installed once, at the first lease, where the platform has `sigaction` with
`SA_SIGINFO` (Linux with glibc: the structure's layout is glibc's); elsewhere nothing is installed and there is no
lease either.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import signal
import threading
from collections.abc import Callable

_log = logging.getLogger("streamwise.load")

_SA_SIGINFO, _SA_RESTART = 4, 0x10000000
_MAP_FIXED = 0x10


class _SigInfo(ctypes.Structure):
    """The head of Linux's `siginfo_t`: for SIGBUS the faulting address follows the three ints and their padding."""

    _fields_ = [("signo", ctypes.c_int), ("errno", ctypes.c_int), ("code", ctypes.c_int), ("pad", ctypes.c_int),
                ("address", ctypes.c_void_p)]


class _SigAction(ctypes.Structure):
    """glibc's `struct sigaction`."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong)))),
                ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(_SigInfo), ctypes.c_void_p)

_lock = threading.RLock()  # re-entrant: a region collected while it is held forgets itself (`forget`)
_regions: dict[int, tuple[int, Callable[[], None]]] = {}
"""Start address -> (length, what marks its lease lost)."""
_previous = _SigAction()
_installed: list = []  # (the C library, the ctypes callback), kept alive for as long as the process


def watch(address: int, length: int, lost: Callable[[], None]) -> bool:
    """Guard `length` bytes at `address`: a SIGBUS there reads zeros and calls `lost`. False where no handler can be
    installed here (the caller then should not map)."""
    with _lock:
        if not _installed_now():
            return False
        _regions[address] = (length, lost)
    return True


def keep_installed() -> None:
    """Take SIGBUS back where a handler installed since took it (checked before and after each forward of a model
    with leased weights: a syscall)."""
    with _lock:
        if _regions:
            _installed_now()


def forget(address: int) -> None:
    """The region at `address` is no longer mapped from the file (copied out, or gone)."""
    with _lock:
        _regions.pop(address, None)


def _installed_now() -> bool:
    """Whether this module's handler takes SIGBUS now: installed at the first lease, and again where another was
    installed since (`faulthandler.enable()`, say), chained to that one."""
    if not _installed:
        libc = _libc()
        if libc is None or not hasattr(signal, "SIGBUS"):
            return False
        _installed.append((libc, _HANDLER(_on_fault)))
    libc, handler = _installed[0]
    ours = ctypes.cast(handler, ctypes.c_void_p).value
    current = _SigAction()
    if libc.sigaction(signal.SIGBUS, None, ctypes.byref(current)) != 0:
        return False
    if current.handler == ours:
        return True
    action = _SigAction(handler=ours, flags=_SA_SIGINFO | _SA_RESTART)
    return libc.sigaction(signal.SIGBUS, ctypes.byref(action), ctypes.byref(_previous)) == 0


def _on_fault(signum: int, info, context) -> None:
    address = info.contents.address or 0
    for start, (length, lost) in list(_regions.items()):
        if start <= address < start + length:
            libc = _installed[0][0]
            zeros = libc.mmap(start, length, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
            if zeros == start:
                _regions.pop(start, None)
                lost()
                return
            break
    # not a leased region's (or it could not be replaced): the handler there was before takes this fault
    libc = _installed[0][0]
    libc.sigaction(signal.SIGBUS, ctypes.byref(_previous), None)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_SigAction), ctypes.POINTER(_SigAction)]
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        return libc
    except (OSError, AttributeError):
        return None
