"""How much host RAM this process can still allocate before the OOM killer takes it.

The loader sizes its host tier by this figure: weights past it stay in their file. `MemAvailable` alone is the
host's, blind to the container the process runs in, so every cgroup memory limit up the process's tree is read as
well (v2 and v1) and the smallest headroom wins. Every source is feature-detected; a missing, unreadable or malformed
file is skipped, never raised on.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import Error
from .sizes import human

_READ_LIMIT = 64 * 1024  # cgroup and /proc files are a few KiB; never read more than this
_MOUNTINFO_LIMIT = 1024 * 1024  # mountinfo grows with the mounts (hundreds on a Kubernetes node)
_V1_UNLIMITED = 2**62  # v1 writes "no limit" as 2**63 rounded down to a page; no machine has 4 EiB
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class HostMemory:
    """What this process may still allocate (`available`), under which ceiling (`total`), and why (`source`)."""

    available: int  # bytes this process can still allocate before a limit or the machine runs out
    total: int  # bytes of the smallest ceiling it lives under (a cgroup limit, or the machine's RAM)
    source: str  # where `available` comes from, in words, with its figures


class HostMemoryError(Error, RuntimeError):
    """No source of host memory figures works here: the user has to give the host budget."""


def host_memory(*, root: str | os.PathLike[str] = "/") -> HostMemory:
    """The host memory this process can still allocate: the least of the machine's and every cgroup level's.

    Machine: `MemAvailable`/`MemTotal` from /proc/meminfo; where that is missing, psutil, then
    `GlobalMemoryStatusEx` on Windows, then `os.sysconf`. Cgroups: each level from the process's own cgroup up to
    the root of the mounted hierarchy that sets a hard limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) gives
    headroom = limit - usage + reclaimable page cache (see `_reclaimable`). `memory.high` is ignored: it throttles
    and reclaims but never OOM-kills, so the hard limit is the one that matters; swap is not counted (it may be off
    or full). `root` relocates /proc and /sys (tests build a fake tree). Raises `HostMemoryError` only when no
    source at all gives a figure.
    """
    base = Path(root)
    figures = _cgroup_v2(base) + _cgroup_v1(base)
    machine = _meminfo(base) or _fallback()
    if machine is not None:
        figures.append(machine)
    if not figures:
        raise HostMemoryError(
            "cannot tell how much host memory this process may use: no /proc/meminfo, no cgroup limit, psutil not "
            "installed, no GlobalMemoryStatusEx and no os.sysconf page counts on this platform; give the host "
            "budget in bytes (for example '16GiB')"
        )
    available, _, source = min(figures, key=lambda figure: figure[0])
    total = min(figure[1] for figure in figures)
    return HostMemory(available=min(available, total), total=total, source=source)


LARGE_FREE = 1 << 20
"""Freed C allocations of at least this many bytes go back to the system at once (`return_large_frees`)."""


@functools.cache
def return_large_frees() -> bool:
    """Have the C allocator hand every freed buffer of `LARGE_FREE` bytes or more back to the system at once;
    whether it could (glibc only).

    glibc serves a buffer below a threshold from its heap, and the threshold rises to the size of each larger
    buffer freed (up to 32 MiB), as does what the heap may keep free (twice that). A forward that expands quantized
    weights layer after layer, each a buffer of MiB, then keeps up to tens of MiB more than it uses, past the host
    budget: a Q8_0 GGUF under a memory cgroup grew 40-80 MiB past its load and was killed about one run in three
    with 96 MiB to spare. A fixed threshold (`mallopt(M_MMAP_THRESHOLD)`, which also stops the rising) maps each
    such buffer on its own and unmaps it when it is freed, at a page fault per page of its first write (the cost the
    loader's huge-page advice cuts): 5-20% on a dequantization. Process-wide, so it is done only once the process
    runs short: when a load leaves weights in their file, and at the first read from a file tier however it came.
    """
    if "CS_GNU_LIBC_VERSION" not in getattr(os, "confstr_names", {}):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, ValueError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, LARGE_FREE) != 1:
        return False
    malloc_trim(0)  # and what the heap keeps free now goes back too
    return True


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


# --- reading ---------------------------------------------------------------------------------------------------


def read_bounded(path: str | os.PathLike[str], limit: int = _READ_LIMIT) -> str | None:
    """The text of a small file, at most `limit` bytes; None when it cannot be read."""
    try:
        with open(path, "rb") as file:
            data = file.read(limit)
    except (OSError, ValueError):
        return None
    if len(data) == limit:  # cut short: drop the partial last line
        data = data[: data.rfind(b"\n") + 1]
    return data.decode("utf-8", errors="replace")


def _parse_int(text: str | None) -> int | None:
    """A file holding one non-negative integer (`memory.max`, `memory.current`); None when it holds anything else."""
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _parse_keyed(text: str | None) -> dict[str, int]:
    """`key value` lines (memory.stat) or `Key: value kB` lines (meminfo), in bytes; malformed lines are skipped."""
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        words = line.replace(":", " ").split()
        if len(words) < 2 or not (words[1].isascii() and words[1].isdigit()):
            continue
        unit = 1024 if words[2:] == ["kB"] else 1 if len(words) == 2 else None
        if unit is not None:
            values[words[0]] = int(words[1]) * unit
    return values


def _shown(path: Path, root: Path) -> str:
    """`path` as the process sees it, without the test root in front."""
    try:
        return "/" + path.relative_to(root).as_posix().lstrip("/")
    except ValueError:
        return str(path)


# --- the machine -----------------------------------------------------------------------------------------------


def _meminfo(root: Path) -> tuple[int, int, str] | None:
    """`MemAvailable` and `MemTotal`: the kernel's estimate of what new allocations get without swapping."""
    path = root / "proc" / "meminfo"
    values = _parse_keyed(read_bounded(path))
    available, total = values.get("MemAvailable"), values.get("MemTotal")
    if available is None or not total:
        return None  # kernels before 3.14 have no MemAvailable: psutil estimates it instead
    return available, total, f"MemAvailable in {_shown(path, root)}"


def _fallback() -> tuple[int, int, str] | None:
    """The machine's free and total RAM where /proc/meminfo is not there: psutil, Windows, then sysconf."""
    try:
        import psutil

        memory = psutil.virtual_memory()
        if memory.total > 0:
            return int(memory.available), int(memory.total), "psutil"
    except Exception:  # not installed, or it cannot read this platform
        pass
    if sys.platform == "win32":
        found = _global_memory_status()
        if found is not None:
            return found
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        available, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):  # no sysconf, or no such name here (macOS has no AVPHYS)
        return None
    return (available, total, "sysconf") if page > 0 and available >= 0 and total > 0 else None


def _global_memory_status() -> tuple[int, int, str] | None:
    """`ullAvailPhys` and `ullTotalPhys` from Windows' `GlobalMemoryStatusEx`."""
    try:
        import ctypes
        from ctypes import wintypes

        class MemoryStatusEx(ctypes.Structure):
            _fields_ = [
                ("dwLength", wintypes.DWORD), ("dwMemoryLoad", wintypes.DWORD),
                ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                ("ullAvailExtendedVirtual", ctypes.c_ulonglong),
            ]

        status = MemoryStatusEx()
        status.dwLength = ctypes.sizeof(MemoryStatusEx)
        if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)) or not status.ullTotalPhys:
            return None
        return int(status.ullAvailPhys), int(status.ullTotalPhys), "GlobalMemoryStatusEx"
    except Exception:  # no ctypes, no windll, or the call itself failed
        return None


# --- cgroups ---------------------------------------------------------------------------------------------------


def _reclaimable(stat: dict[str, int], prefix: str, dirty: str, writeback: str, mapped: str) -> int | None:
    """Page cache the kernel drops before it OOM-kills: both file LRU lists, less what it cannot drop cheaply.

    Both `active_file` and `inactive_file` count: reclaim deactivates active pages before the OOM killer runs, and
    a checkpoint read twice (the loader's own cache) sits on the active list. Less dirty and writeback pages (they
    need I/O first, which reclaim under a limit may not finish in time) and mapped pages (shared libraries such as
    libtorch's, and code: the kernel shields them and evicting them only thrashes). Conservative on purpose: an
    estimate too low leaves weights in their file; one too high is the OOM killer. None when a key is missing.
    """
    try:
        cache = stat[prefix + "inactive_file"] + stat[prefix + "active_file"]
        pinned = stat[prefix + dirty] + stat[prefix + writeback] + stat[prefix + mapped]
    except KeyError:
        return None
    return max(0, cache - pinned)


def _headroom(limit: int, usage: int, reclaimable: int | None, where: str, limit_name: str) -> tuple[int, int, str]:
    """What a level with a hard limit leaves: limit - usage + reclaimable cache, never below zero."""
    counted = min(reclaimable or 0, usage)
    cache = (f"of which {human(counted)} reclaimable page cache" if reclaimable is not None
             else "memory.stat unreadable, so no page cache counted")
    return (max(0, limit - usage + counted), limit,
            f"{where}: {limit_name} {human(limit)}, {human(usage)} in use {cache}")


def _own_cgroups(root: Path) -> tuple[str | None, str | None]:
    """The process's v2 cgroup path (`0::/path`) and v1 memory cgroup path (`N:...memory...:/path`)."""
    v2 = v1 = None
    for line in (read_bounded(root / "proc" / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _mounts(root: Path, fstype: str, option: str | None) -> list[tuple[str, str]]:
    """(cgroup seen at the mount, mount point) of each `fstype` mount in /proc/self/mountinfo with `option`."""
    found = []
    for line in (read_bounded(root / "proc" / "self" / "mountinfo", _MOUNTINFO_LIMIT) or "").splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 4 or fields[dash + 1] != fstype:
            continue
        if option is None or option in fields[dash + 3].split(","):
            found.append((_unescape(fields[3]), _unescape(fields[4])))
    return found


def _unescape(field: str) -> str:
    r"""mountinfo's octal escapes (`\040` for a space) undone."""
    return _OCTAL.sub(lambda match: chr(int(match.group(1), 8)), field)


def _levels(root: Path, own: str, mounts: list[tuple[str, str]], default: str) -> list[Path]:
    """The process's cgroup directory and each ancestor up to the mount's root, innermost first.

    The mount's root is cut from the front of the process's path (a container without its own cgroup namespace
    sees its own cgroup mounted at /sys/fs/cgroup). Without mountinfo the default mount is assumed; levels that do
    not exist are skipped by the reader, so the mount point itself is always read.
    """
    own_path = PurePosixPath(own)
    for seen, point in mounts or [("/", default)]:
        seen_path = PurePosixPath(seen)
        if ".." in own_path.parts or ".." in seen_path.parts:
            continue
        try:
            parts = own_path.relative_to(seen_path).parts
        except ValueError:
            continue  # this mount shows another part of the tree, not one of our ancestors
        mount = root / point.lstrip("/")
        return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return []


def _cgroup_v2(root: Path) -> list[tuple[int, int, str]]:
    """Headroom at each v2 level with `memory.max` set, from the process's cgroup up."""
    own, _ = _own_cgroups(root)
    if own is None:
        return []
    figures = []
    for level in _levels(root, own, _mounts(root, "cgroup2", None), "/sys/fs/cgroup"):
        limit = _parse_int(read_bounded(level / "memory.max"))  # "max" (no limit) and malformed both skip the level
        usage = _parse_int(read_bounded(level / "memory.current"))
        if limit is None or usage is None:
            continue
        stat = _parse_keyed(read_bounded(level / "memory.stat"))
        reclaimable = _reclaimable(stat, "", "file_dirty", "file_writeback", "file_mapped")
        figures.append(_headroom(limit, usage, reclaimable, f"cgroup v2 {_shown(level, root)}", "memory.max"))
    return figures


def _cgroup_v1(root: Path) -> list[tuple[int, int, str]]:
    """Headroom at each v1 memory-controller level with a limit, from the process's cgroup up."""
    _, own = _own_cgroups(root)
    if own is None:
        return []
    figures = []
    for level in _levels(root, own, _mounts(root, "cgroup", "memory"), "/sys/fs/cgroup/memory"):
        limit = _parse_int(read_bounded(level / "memory.limit_in_bytes"))
        usage = _parse_int(read_bounded(level / "memory.usage_in_bytes"))
        if limit is None or usage is None or limit >= _V1_UNLIMITED:
            continue
        stat = _parse_keyed(read_bounded(level / "memory.stat"))  # the total_* keys count the level's descendants too
        reclaimable = _reclaimable(stat, "total_", "dirty", "writeback", "mapped_file")
        figures.append(_headroom(limit, usage, reclaimable, f"cgroup v1 {_shown(level, root)}",
                                 "memory.limit_in_bytes"))
    return figures
