"""The host tier on the page cache: a checkpoint's bytes mapped under a read lease, copied the moment anyone would
change them.

A private copy of every weight (`checked_file`) keeps a loaded model's numbers whatever happens to its file, but it
costs fresh memory the kernel cannot drop, and on many machines faulting that memory in takes longer than a forward.
A memory map costs neither, and transformers and llama.cpp use one, but a file rewritten under it changes the numbers
and a truncated one is a SIGBUS. Linux has the missing piece: a read lease (`fcntl(F_SETLEASE, F_RDLCK)`). While it
is held, nobody has the file open for writing, and whoever opens it to write or truncates it is held by the kernel
until the lease is given back (`/proc/sys/fs/lease-break-time`, 45 s by default). A watcher thread sees the lease
break, copies each mapped region into anonymous memory and moves it over the mapping's own addresses (`mremap`), so
every tensor viewing it keeps its address and values; then it gives the lease back and the writer goes on. The model
computes the same numbers, as with a private copy; it paid for the copy only if the file was changed.

Leases are taken only where they see every change: a local file system (`LOCAL_FILE_SYSTEMS`, from
/proc/self/mountinfo; a network file system's other clients write past a local lease), a file this process may lease
(its owner, or CAP_LEASE), nobody writing it now, and no more bytes in all than the watcher can surely copy within
the break time (`COPY_RATE`). Elsewhere (Windows, macOS, NFS, FUSE, a file another user owns), or with
`STREAMWISE_LEASE=0`, `map_ranges` says no and the load copies. What a lease cannot hold off: the break time running
out while the watcher cannot copy (the process stopped), the process's own thread writing the file while it keeps the
interpreter's lock (`lease_keeper` gives that lease back at once instead of after the break time), a disk that fails
reading a page the kernel dropped under memory pressure, and writes to the block device under the file system. Where
a region's pages vanish, `fault_guard` makes a SIGBUS there zeros and marks the lease lost; a file changed before
its copy marks it lost too; `check` then turns the model's forward into a `CheckpointError`.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..host_memory import read_bounded
from . import fault_guard, lease_keeper
from .checked_file import CheckedFile
from .errors import CheckpointError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

_log = logging.getLogger("streamwise.load")

LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "zfs", "bcachefs", "jfs"})
"""File systems whose every write goes through this kernel, so a local lease sees it."""
COPY_RATE = 500_000_000
"""Bytes a second the watcher surely copies (a slow machine faulting in fresh memory): what may be leased at once is
what it copies in half the break time."""
POLL_SECONDS = 0.02
"""How often the watcher looks for a broken lease: a writer waits this long at most before the copy starts."""
_SIGNAL = getattr(__import__("signal"), "SIGURG", None)
"""The signal a lease break sends (`F_SETSIG`): SIGURG, which every process ignores unless it asks for it (the default
SIGIO would end the process)."""
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_POPULATE_READ = 22
_CHUNK = 64 << 20
_READ_AHEAD = 16 << 20
"""Bytes a reader brings in at a time: small enough that the readers stay near the file order the forward
needs (64 MiB made a cold first forward 1.5x slower on the benchmark's VM)."""


_CHANGED_BEFORE_COPY = ("was changed before the model's mapping of it could be copied (this process's own thread wrote "
                        "it while holding the interpreter's lock, as torch.save does, or the process was stopped or "
                        "busy for the kernel's whole lease-break time)")


def map_ranges(file: CheckedFile, ranges: list[tuple[int, int]]) -> list[Tensor] | None:
    """Each (offset, nbytes) of `file` as a uint8 tensor viewing its bytes in the page cache, under a lease that
    keeps them as they are; None where no lease is possible here (the caller copies instead)."""
    total = sum(nbytes for _, nbytes in ranges)
    if not total or not _leasing_possible(file):
        return None
    with _WATCHER.lock:
        if _WATCHER.leased + total > _lease_cap():
            return None
        descriptor = _lease(file)
        if descriptor is None:
            return None
        try:
            views = _Lease(file, descriptor, total).map(ranges)
        except (OSError, ValueError) as exc:  # out of address space, or the mapping refused: copy instead
            _log.debug("streamwise: mapping %s failed (%s); copying instead", file.path, exc)
            _release(descriptor)
            return None
        _WATCHER.leased += total
    return views


@dataclass(eq=False)
class _Lease:
    """One leased descriptor and the regions mapped from it (weakly: the tensors viewing a region keep it)."""

    file: CheckedFile
    descriptor: int
    nbytes: int
    regions: list[tuple[weakref.ref, int, int]] = field(default_factory=list)
    """(the region's mmap, its address, its length)."""
    lost: str | None = None
    """What took the mapped values (the file cut under the mapping, or changed before they were copied): they are
    zeros now, and every check of the lease raises."""

    @property
    def path(self) -> Path:
        return self.file.path

    def mark_lost(self, what: str) -> None:
        if self.lost is None:
            self.lost = what
            _log.error("streamwise: %s %s; the model's next forward raises instead of computing from it", self.path,
                       what)

    def map(self, ranges: list[tuple[int, int]]) -> list[Tensor]:
        """Map the ranges, neighbours within a page sharing one region, and register the lease with the watcher
        (which must hold its lock)."""
        views: list[Tensor | None] = [None] * len(ranges)
        granule = mmap.ALLOCATIONGRANULARITY
        group: list[int] = []
        end = 0
        for index in sorted(range(len(ranges)), key=lambda index: ranges[index][0]) + [None]:
            if group and (index is None or ranges[index][0] > end + granule):
                start = ranges[group[0]][0] // granule * granule
                region = mmap.mmap(self.descriptor, end - start, offset=start, access=mmap.ACCESS_COPY)
                address = _address(region)
                if not fault_guard.watch(address, end - start, self._cut):
                    raise OSError("no fault handler can guard a mapping here")
                weakref.finalize(region, fault_guard.forget, address)
                self.regions.append((weakref.ref(region), address, end - start))
                for member in group:
                    offset, nbytes = ranges[member]
                    views[member] = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset - start)
                group, end = [], 0
            if index is not None:
                group.append(index)
                end = max(end, ranges[index][0] + ranges[index][1])
        _WATCHER.add(self)
        _READER.read_ahead(self.regions)
        return views

    def live(self) -> list[tuple[int, int]]:
        return [(address, length) for region, address, length in self.regions if region() is not None]

    def _cut(self) -> None:
        self.mark_lost("was cut short under the model's mapping of it (its values read as zeros now)")

    def unchanged(self) -> bool:
        """Whether the leased file's bytes are as they were: its size and modification time (not its change time,
        which a rename over it or a new link moves while the bytes stay)."""
        try:
            status = os.fstat(self.descriptor)
        except OSError:
            return False
        return (status.st_size, status.st_mtime_ns) == self.file.identity[2:4]

    def copy_out(self) -> None:
        """Every live region moved into anonymous memory of its own at the same address, then the lease given back:
        the writer the kernel holds goes on, and the tensors keep the values they had. A file already changed (the
        break time ran out while this process could not copy: it was stopped, or its own thread held the
        interpreter's lock while writing the file) or changed during the copy marks the lease lost instead."""
        if not self.unchanged():
            self.mark_lost(_CHANGED_BEFORE_COPY)
        copied = 0
        for address, length in self.live() if self.lost is None else []:  # lost values are not worth a copy
            fresh = _LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            if fresh in (None, ctypes.c_void_p(-1).value):
                _log.error("streamwise: %s is being changed, but there is no memory to copy what the model maps of "
                           "it; a truncation of it will make the model raise", self.path)
                break
            _copy(fresh, address, length)
            if _LIBC.mremap(fresh, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) != address:
                _log.error("streamwise: %s is being changed, but moving the copy of a region over its mapping failed "
                           "(errno %d); a truncation of it will make the model raise", self.path, ctypes.get_errno())
                break
            fault_guard.forget(address)
            copied += length
        if not self.unchanged():
            self.mark_lost("was changed while the model's mapping of it was being copied")
        _release(self.descriptor)
        if copied and self.lost is None:
            _log.info("streamwise: %s is being changed: the %d MiB the model maps of it were copied into memory of its "
                      "own, so its numbers stay the same", self.path, copied >> 20)


def leases_of(tensors: list[Tensor]) -> list[_Lease]:
    """The leases whose mapped regions `tensors` view (a loaded model's host tier)."""
    with _WATCHER.lock:
        regions = [(address, length, lease) for lease in _WATCHER.leases for _, address, length in lease.regions]
    found: dict[int, _Lease] = {}
    for tensor in tensors:
        pointer = tensor.untyped_storage().data_ptr()
        for address, length, lease in regions:
            if address <= pointer < address + length:
                found[id(lease)] = lease
    return list(found.values())


class LeaseCheck:
    """A loaded model's `check` of the leases its weights are mapped under, run before and after each forward (as
    forward hooks). A copy of the model (deep-copied, pickled) holds copies of the weights: its check has no lease. A
    graph compiled from the whole model checks nothing (a lock and syscalls have no place in it); `lazy_compile`
    compiles regions, leaving the root's hooks eager."""

    def __init__(self, leases: list[_Lease]) -> None:
        self.leases = leases

    def __call__(self, module, *hook_arguments) -> None:
        if not torch.compiler.is_compiling():
            check(self.leases)

    def __reduce__(self):
        return LeaseCheck, ([],)


def check(leases: list[_Lease]) -> None:
    """A CheckpointError where a lease's mapped values are gone: cut under the mapping (a fault read zeros), or the
    file changed before they could be copied, which a lease still held but broken shows before its watcher does (a
    process resumed after the break time). Before that, SIGBUS is taken back where another handler took it since."""
    fault_guard.keep_installed()
    with _WATCHER.lock:  # not while the watcher copies or gives the descriptor back
        for lease in leases:
            if lease.lost is None and lease in _WATCHER.leases and not lease.unchanged():
                lease.mark_lost(_CHANGED_BEFORE_COPY)
    lost = [lease for lease in leases if lease.lost is not None]
    if lost:
        raise CheckpointError([f"{lease.path}: the file {lease.lost}, so the weights the model mapped from it are "
                               "gone: load the model again (with STREAMWISE_LEASE=0 its weights are copied into "
                               "memory of its own, which no change to the file can take)" for lease in lost])


def _copy(destination: int, source: int, length: int) -> None:
    """`memmove` in `_CHUNK`-byte pieces over a few threads: faulting in fresh memory is most of the copy, and
    one thread does it several times slower than a few."""
    starts = range(0, length, _CHUNK)
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1, len(starts)), thread_name_prefix="streamwise-copy") as pool:
        for _ in pool.map(lambda start: ctypes.memmove(destination + start, source + start,
                                                       min(_CHUNK, length - start)), starts):
            pass


def _address(region: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(region)  # an export of the buffer, dropped at once: the region can close later
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


class _Reader:
    """Threads (one a CPU, four at most) that bring mapped regions into memory behind the load, in file order and
    `_READ_AHEAD` bytes at a time (`MADV_POPULATE_READ`), so a cold file is read by several requests at once while
    the first forward computes, instead of one page fault at a time by it. A region gone meanwhile is skipped; a
    range the kernel cannot read is left to the forward's own faults (the lease holds the file: nothing truncates
    it)."""

    THREADS = 4

    def __init__(self) -> None:
        self.chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.started = 0
        self.lock = threading.Lock()

    def read_ahead(self, regions: list[tuple[weakref.ref, int, int]]) -> None:
        for region, address, length in regions:
            for start in range(0, length, _READ_AHEAD):
                self.chunks.put((region, address + start, min(_READ_AHEAD, length - start)))
        with self.lock:
            while self.started < min(self.THREADS, os.cpu_count() or 1):
                self.started += 1
                threading.Thread(target=self._run, name="streamwise-map-reader", daemon=True).start()

    def _run(self) -> None:
        while True:
            region, address, length = self.chunks.get()
            if region() is not None:  # ctypes lets the GIL go: the forward runs meanwhile
                if _LIBC.madvise(address, length, _MADV_POPULATE_READ) != 0 and hasattr(mmap, "MADV_WILLNEED"):
                    _LIBC.madvise(address, length, mmap.MADV_WILLNEED)  # a kernel before 5.14: advice only
            del region


_READER = _Reader()


class _Watcher:
    """The thread that looks after every lease of the process: a broken one is copied out and given back, one whose
    regions are all gone is given back; it ends when no lease is left."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leases: list[_Lease] = []
        self.leased = 0
        self.thread: threading.Thread | None = None

    def add(self, lease: _Lease) -> None:
        self.leases.append(lease)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="streamwise-lease-watcher", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.leases:
                    self.thread = None
                    return
                for lease in list(self.leases):
                    try:
                        if fcntl.fcntl(lease.descriptor, fcntl.F_GETLEASE) != fcntl.F_RDLCK:
                            _KEEPER.forget(lease.descriptor)  # this process copies: the keeper lets go
                            lease.copy_out()
                        elif lease.live():
                            continue
                        else:
                            _release(lease.descriptor)
                    except Exception:  # never the thread's end: the other leases still need it
                        _log.exception("streamwise: looking after the lease on %s failed", lease.path)
                    self.leases.remove(lease)
                    self.leased -= lease.nbytes
            time.sleep(POLL_SECONDS)


_WATCHER = _Watcher()


class _Keeper:
    """This process's side of the lease keeper (`lease_keeper`): started at the first lease, told which leases to keep
    and forget. A keeper that cannot start or has gone is a debug line and nothing more: without it a write by this
    process's own thread that keeps the interpreter's lock waits out the lease-break time, as before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channel: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        self._owner: int | None = None
        """The process that started the keeper: a process forked from it does not speak to it."""

    def keep(self, descriptor: int) -> None:
        with self._lock:
            if self._owner is None:
                self._start()
            self._send(True, descriptor)

    def forget(self, descriptor: int) -> None:
        """The holder gives the lease back itself (or copies first): the keeper lets go of its copy."""
        with self._lock:
            self._send(False, descriptor)

    def _start(self) -> None:
        self._owner = os.getpid()
        if "python" not in os.path.basename(sys.executable or "").lower():  # embedded: running it might be an app
            _log.debug("streamwise: no lease keeper: %r is not a Python interpreter to run it with", sys.executable)
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", lease_keeper.__file__, str(self._owner), str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)  # no terminal signal (Ctrl-C, Ctrl-Z) reaches it: it ends with its holder
        except (OSError, ValueError) as exc:
            _log.debug("streamwise: no lease keeper (%s): a write by this process's own thread that keeps the "
                       "interpreter's lock waits out the lease-break time", exc)
            ours.close()
        else:
            self._channel = ours
            weakref.finalize(self, _stop, self._owner, ours, self._process)  # at exit too: no keeper left behind
        finally:
            theirs.close()

    def _send(self, keep: bool, descriptor: int) -> None:
        if self._channel is None or os.getpid() != self._owner:
            return
        try:
            socket.send_fds(self._channel, [lease_keeper.MESSAGE.pack(keep, descriptor)], [descriptor] if keep else [],
                            socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError as exc:  # gone, or not reading: never block the holder on it
            _log.debug("streamwise: the lease keeper is gone (%s)", exc)
            self._channel.close()
            self._channel = None


def _stop(owner: int, channel: socket.socket, process: subprocess.Popen) -> None:
    """Close the channel, which ends the keeper, and reap it."""
    channel.close()
    if os.getpid() == owner:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


_KEEPER = _Keeper()


def _leasing_possible(file: CheckedFile) -> bool:
    if fcntl is None or _LIBC is None or _SIGNAL is None or not hasattr(fcntl, "F_SETLEASE"):
        return False
    if os.environ.get("STREAMWISE_LEASE", "1").strip() in ("0", "no", "off", "false"):
        return False
    return file_system(file.identity[0]) in LOCAL_FILE_SYSTEMS


def file_system(device: int) -> str | None:
    """The type of the mounted file system device number `device` is on (/proc/self/mountinfo), or None."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    for line in (read_bounded("/proc/self/mountinfo", 1 << 20) or "").splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == wanted and " - " in line:
            return line.split(" - ", 1)[1].split()[0]
    return None


def _lease(file: CheckedFile) -> int | None:
    """A read-only descriptor on `file` holding a read lease, the file still the one that was checked; None where
    the kernel refuses one (not the owner, a writer has it open, leases off) or the file changed."""
    try:
        descriptor = file.open_checked()
    except Exception:  # changed or gone: the copying read says so, with the file named
        return None
    try:
        fcntl.fcntl(descriptor, fcntl.F_SETSIG, _SIGNAL)
        fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        file.check(os.fstat(descriptor))  # changed between the last check and the lease: copy, and be told there
    except Exception:
        os.close(descriptor)
        return None
    _KEEPER.keep(descriptor)
    return descriptor


def _release(descriptor: int) -> None:
    _KEEPER.forget(descriptor)
    lease_keeper.give_back(descriptor)


def _lease_cap() -> int:
    """Bytes that may be leased at once: what the watcher copies in half the break time."""
    seconds = read_bounded("/proc/sys/fs/lease-break-time", 64)
    seconds = int(seconds) if seconds and seconds.strip().isdigit() else 45
    return seconds * COPY_RATE // 2


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError, TypeError):  # no C library by that name, or no mremap (not Linux)
        return None


_LIBC = _libc()
