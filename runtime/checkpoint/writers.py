"""Whether anyone may change a checkpoint's bytes without the file tier seeing it: a shared writable mapping.

The file tier reads a unit's bytes at each fetch and compares the file's identity (device, inode, size, modification
and change times) before and after. A process writing through `write()` stamps a new modification time at once; one
writing through a shared writable mapping (`numpy.memmap(mode="r+")`, an in-place mmap editor) stamps one only when
a clean page is first dirtied, so writes to pages already dirty when the model was loaded change the bytes the next
fetch reads with no new time until they are written back (about 30 s later). A model must never compute with those:
a load that would leave units in such a file is refused instead (`refuse_mapped_for_writing`).

How it is seen (Linux): a read lease is refused (`EAGAIN`) exactly while someone has the file open for writing, which
a shared writable mapping does until it is unmapped; only then is every process's map read (`/proc/<pid>/maps`, a
few milliseconds for a hundred processes) for a shared mapping of the file with write permission. Not seen: a
process whose maps this user cannot read (another user's, which would need write permission on the file too; taking
every such process for a writer would refuse any file open for writing at all, a seeding torrent client's), and
every process where neither a lease nor `/proc` exists (Windows, macOS); the documentation says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checked_file import CheckedFile
from .errors import CheckpointError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

_PROC = Path("/proc")


def refuse_mapped_for_writing(files: list[CheckedFile], needed: str) -> None:
    """A CheckpointError naming each of `files` a process maps shared and writable, saying why its weights cannot stay
    in it and what to do (`needed`: the host budget that holds them)."""
    problems = []
    for file in files:
        writer = mapped_for_writing(file)
        if writer is not None:
            problems.append(
                f"{file.path}: {writer} maps it shared and writable, so its bytes may change with no new modification "
                "time until they are written back, which the file tier cannot see: weights left in it could compute "
                f"other numbers. Close that mapping (or that process), or give a host budget of at least {needed}, "
                "which keeps every weight in memory")
    if problems:
        raise CheckpointError(problems)


def mapped_for_writing(file: CheckedFile) -> str | None:
    """Which process this user can see maps `file` shared and writable (`process 1234 (python)`), or None."""
    if not _open_for_writing(file) or not _PROC.is_dir():
        return None
    device, inode = file.identity[:2]
    for process in _PROC.iterdir():
        if not process.name.isdigit():
            continue
        try:
            maps = (process / "maps").read_text(errors="replace")
        except OSError:  # another user's, or ended meanwhile
            continue
        if any(_maps_for_writing(line, device, inode) for line in maps.splitlines()):
            return f"process {process.name} ({_name(process)})"
    return None


def _open_for_writing(file: CheckedFile) -> bool:
    """Whether someone has `file` open for writing: a read lease refused with EAGAIN says so exactly. Where no lease
    can be asked (not the owner, a file system without them, no `fcntl`), True: only the maps can tell."""
    if fcntl is None or not hasattr(fcntl, "F_SETLEASE"):
        return True
    try:
        descriptor = file.open_checked()
    except CheckpointError:
        return True  # the fetch's own check says what changed
    try:
        fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # EAGAIN: open for writing; any other refusal: the maps must tell
        return True
    else:
        fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(descriptor)


def _maps_for_writing(line: str, device: int, inode: int) -> bool:
    """Whether a `/proc/<pid>/maps` line maps (`device`, `inode`) shared with write permission (`rw-s`). The line's
    device is the file system's own, which `stat` does not give for a btrfs subvolume: there the mapped path is
    looked at instead."""
    fields = line.split(maxsplit=5)
    if len(fields) < 5 or len(fields[1]) < 4 or fields[1][1] != "w" or fields[1][3] != "s" or fields[4] != str(inode):
        return False
    major, _, minor = fields[3].partition(":")
    try:
        if os.makedev(int(major, 16), int(minor, 16)) == device:
            return True
        status = os.stat(fields[5]) if len(fields) > 5 else None
    except (ValueError, OSError):
        return False
    return status is not None and (status.st_dev, status.st_ino) == (device, inode)


def _name(process: Path) -> str:
    try:
        return (process / "comm").read_text().strip()
    except OSError:
        return "ended"
