"""A checkpoint file as its header was checked: tensors are read from it into memory of their own, and a file that
changed since is refused.

A memory map would make the loaded model depend on the file staying as it was: a file rewritten in place (a
re-download, a sync client) changes the next forward's numbers, and a truncated one kills the process with SIGBUS
on the next touch of a page past its new end. So nothing is mapped here (`leased` maps only under a read lease, which
copies before anyone can change the file): each tensor is read with plain reads into a fresh allocation when the
loader asks for it, and the file's identity (device, inode, size, modification and change
times) is compared with the one its header was read under, before and after every read. A file replaced, truncated
or rewritten meanwhile is a `CheckpointError` naming it (a short read is one too, never a signal), and a loaded model
holds nothing of the file at all. The price: the bytes are copied once, as a map's pages would have been faulted in
once, and they are the process's own memory, which the kernel cannot drop and read again under memory pressure
(README, *Hostile input*, has the measured cost). A rewrite within the file system's timestamp granularity that keeps
the size is the one change this cannot see.
"""

from __future__ import annotations

import bisect
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from .errors import CheckpointError

_FADVISE = getattr(os, "posix_fadvise", None)  # Unix only: advice, never needed for a right answer


_PROC_FD = "/proc/self/fd"  # where Linux names a process's descriptors by path (absent where /proc is not mounted)
_FSCTL_SET_SPARSE = 0x900C4


def _extend(descriptor: int, size: int) -> None:
    """Lengthen the open file to `size` bytes, zeros past what was written, without writing those zeros where the
    platform allows: `ftruncate` leaves a hole on Unix file systems, but Windows' C runtime writes every zero, so
    there the file is marked sparse and its end set with the Win32 calls (nothing written, a hole on NTFS)."""
    if os.name == "nt" and _extend_windows(descriptor, size):
        return
    os.ftruncate(descriptor, size)


def _extend_windows(descriptor: int, size: int) -> bool:
    """`FSCTL_SET_SPARSE` (advice: a FAT volume has no holes), then `SetEndOfFile` at `size`; False where a call
    is missing or fails, for `ftruncate` to do it the slow way."""
    try:
        import ctypes
        import msvcrt
        from ctypes import wintypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        handle = wintypes.HANDLE(msvcrt.get_osfhandle(descriptor))
        returned = wintypes.DWORD()
        kernel32.DeviceIoControl(handle, wintypes.DWORD(_FSCTL_SET_SPARSE), None, wintypes.DWORD(0), None,
                                 wintypes.DWORD(0), ctypes.byref(returned), None)
        moved = kernel32.SetFilePointerEx(handle, ctypes.c_longlong(size), None, wintypes.DWORD(0))  # FILE_BEGIN
        return bool(moved and kernel32.SetEndOfFile(handle) and os.fstat(descriptor).st_size == size)
    except Exception:  # no Win32 here (ImportError, AttributeError), or a call refused: the slow way is right too
        return False


def read_at(handle, view: memoryview, offset: int) -> int:
    """Read into `view` from byte `offset` of the open file `handle`: the bytes read (0 at the file's end). Every read
    of a tensor's bytes goes through here (loads, the file tier, its read-ahead), so a failing read is caught in one
    place (and can be made to fail in tests)."""
    handle.seek(offset)
    return handle.readinto(view)


def _identity(status: os.stat_result) -> tuple[int, ...]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


class CheckedFile:
    """The file at `path` as `handle` (open on it, its header being read) sees it now."""

    def __init__(self, path: Path, handle) -> None:
        self.path = path
        self.identity = _identity(os.fstat(handle.fileno()))
        self.size = self.identity[2]
        self._starts: list[int] = []
        self._tensors: list[tuple[int, str]] = []  # (end, name), in the order of `_starts`

    def name_tensors(self, spans: dict[str, tuple[int, int]]) -> None:
        """Record where each tensor's bytes lie ((offset, nbytes) by name, from the header the reader checked), so a
        failing read names the tensor it was reading."""
        ordered = sorted((offset, offset + nbytes, name) for name, (offset, nbytes) in spans.items())
        self._starts = [start for start, _, _ in ordered]
        self._tensors = [(end, name) for _, end, name in ordered]

    def read(self, offset: int, nbytes: int) -> Tensor:
        """The `nbytes` bytes at `offset`, as a fresh uint8 tensor; a CheckpointError if the file changed."""
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.read_into([(offset, buffer)])
        return buffer

    def read_into(self, ranges: list[tuple[int, Tensor]], *, drop_cache: bool = False) -> None:
        """Fill each contiguous CPU tensor of `ranges` with the file's bytes from its offset on, through one
        descriptor whose identity is checked before and after; a CheckpointError if the file changed or ends early.
        `drop_cache` tells the kernel the ranges' page cache is no longer needed (`POSIX_FADV_DONTNEED`), so a copy
        kept in memory is not charged twice under a memory limit."""
        descriptor = self._open()
        with open(descriptor, "rb", buffering=0) as handle:
            self.check(os.fstat(descriptor))
            for offset, out in ranges:
                nbytes = out.nbytes
                if nbytes == 0:
                    continue
                view, done = memoryview(out.view(torch.uint8).reshape(-1).numpy()), 0
                while done < nbytes:
                    try:
                        count = read_at(handle, view[done:], offset + done)
                    except OSError as exc:
                        failed = self.read_failed(offset + done, nbytes - done, exc)
                    else:
                        failed = None
                    if failed is not None:
                        self._check_if_readable(descriptor)  # a file changed meanwhile is said as such
                        raise failed
                    if not count:
                        raise self.changed(f"it ends at byte {offset + done}, inside a tensor's data")
                    done += count
            self.check(os.fstat(descriptor))
            if drop_cache and _FADVISE is not None:
                for offset, out in ranges:
                    _FADVISE(descriptor, offset, out.nbytes, os.POSIX_FADV_DONTNEED)

    def advise(self, ranges: list[tuple[int, int]]) -> None:
        """Ask the kernel to start reading each (offset, nbytes) into the page cache now (`POSIX_FADV_WILLNEED`):
        reads queued ahead of the reads that will need them. Advice only, no check: where the platform has no
        `posix_fadvise` or the file cannot be opened, nothing happens and the later read says what is wrong."""
        if _FADVISE is None:
            return
        try:
            descriptor = self._open()
        except CheckpointError:
            return
        try:
            for offset, nbytes in ranges:
                _FADVISE(descriptor, offset, nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(descriptor)

    def open_checked(self) -> int:
        """A fresh read-only descriptor on the path, the file on it still the one that was checked."""
        descriptor = self._open()
        try:
            self.check(os.fstat(descriptor))
        except CheckpointError:
            os.close(descriptor)
            raise
        return descriptor

    def _open(self) -> int:
        """A fresh read-only descriptor on the path. Where the platform has `O_NONBLOCK`, a FIFO put in the file's
        place opens at once and fails the identity check; elsewhere (Windows) there are no FIFOs to block on."""
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        try:
            return os.open(self.path, flags)
        except OSError as exc:
            raise self.changed(f"it cannot be opened again ({exc.strerror})") from None

    @contextmanager
    def private_copy(self, head: int) -> Iterator[str]:
        """A path to a private file of this file's size holding its first `head` bytes (its header) and zeros after:
        for a reader that maps a path (transformers' GGUF reader), which then sees exactly the header that was
        checked, and cannot be killed by a truncation of the real file. Where the platform has anonymous memory files
        and names descriptors by path (`memfd_create` and `/proc/self/fd`: Linux) it costs no disk; elsewhere (Windows,
        macOS, a Linux without /proc) it is `header.gguf` in a private temporary folder (mode 0700), sparse where the
        file system allows, closed before its path is handed out and removed after."""
        data = self.read(0, head).numpy()
        if hasattr(os, "memfd_create") and os.path.isdir(_PROC_FD):
            descriptor = os.memfd_create("streamwise-header", os.MFD_CLOEXEC)
            try:
                with open(descriptor, "wb", closefd=False) as handle:
                    handle.write(data)
                os.ftruncate(descriptor, self.size)  # sparse: the tensor data costs nothing
                yield f"{_PROC_FD}/{descriptor}"
            finally:
                os.close(descriptor)
            return
        # a folder of its own: nobody else can put a file at the path, and the reader's own folder lookups find
        # nothing else there; a file a reader still maps at the end (Windows cannot remove it) is left to the system
        with tempfile.TemporaryDirectory(prefix="streamwise-", ignore_cleanup_errors=True) as folder:
            path = os.path.join(folder, "header.gguf")
            with open(path, "xb") as handle:
                handle.write(data)
                handle.flush()
                _extend(handle.fileno(), self.size)
            yield path

    def verify(self) -> None:
        """A CheckpointError if the file at the path is no longer the one whose header was read."""
        try:
            status = os.stat(self.path)
        except OSError as exc:
            raise self.changed(f"it cannot be found again ({exc.strerror})") from None
        self.check(status)

    def check(self, status: os.stat_result) -> None:
        """A CheckpointError if `status` is not the identity the header was read under."""
        now = _identity(status)
        if now == self.identity:
            return
        if now[:2] != self.identity[:2]:
            raise self.changed("another file was put in its place")
        if now[2] != self.size:
            raise self.changed(f"its size went from {self.size} to {now[2]} bytes")
        raise self.changed("it was rewritten")

    def _check_if_readable(self, descriptor: int) -> None:
        try:
            status = os.fstat(descriptor)
        except OSError:
            return
        self.check(status)

    def read_failed(self, at: int, nbytes: int, error: OSError) -> CheckpointError:
        """A read the system refused (EIO from a failing disk, a network file system gone): the file is as it was, so
        the same read may succeed later, and the model computes the same numbers again then."""
        index = bisect.bisect_right(self._starts, at) - 1
        end, name = self._tensors[index] if index >= 0 else (0, "")
        tensor = f"tensor `{name}`: " if at < end else ""
        reason = error.strerror or str(error) or type(error).__name__
        code = f", errno {error.errno}" if error.errno else ""
        return CheckpointError([f"{self.path}: {tensor}reading {nbytes} bytes at byte {at} failed ({reason}{code}); "
                                "the file did not change, the system could not read it (a failing disk, a network "
                                "file system gone): the model computes again once its reads succeed"])

    def changed(self, how: str) -> CheckpointError:
        return CheckpointError([f"{self.path}: the file changed after its header was read ({how}); its tensors "
                                "would no longer be the ones checked: load it again once it is complete"])


def file_type(path: Path) -> int | None:
    """The `stat` file type of `path`, None where nothing is there; a path the system refuses (a name
    too long, a NUL byte) is a CheckpointError rather than the OSError or ValueError it raises."""
    try:
        return stat.S_IFMT(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CheckpointError([f"{str(path)!r}: not a usable path ({reason})"]) from None


def check_regular(path: Path) -> None:
    """Refuse anything but a regular file before opening it: a FIFO would block the open forever."""
    kind = file_type(path)
    if kind is None:
        raise CheckpointError([f"{path}: no such file"])
    if kind != stat.S_IFREG:
        raise CheckpointError([f"{path}: not a regular file (a folder, pipe or device); a checkpoint must be a file"])
