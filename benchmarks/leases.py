"""What the GPU checks need to see a leased host tier from outside: a folder a lease works in, which tensors still
view their file's mapping (read off /proc/self/maps, not asked of Streamwise), and a writer changing the file under
a loaded model, timed (the kernel holds it until the lease is given back)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from streamwise.runtime.checkpoint import leased


def lease_folder() -> tempfile.TemporaryDirectory:
    """A temporary folder on a file system leases see every write on: /dev/shm where the default temporary folder
    is not one (an overlay root, as on container images), else the default."""
    default = tempfile.gettempdir()
    for candidate in (default, "/dev/shm"):
        if os.path.isdir(candidate) and file_system(candidate) in leased.LOCAL_FILE_SYSTEMS:
            return tempfile.TemporaryDirectory(dir=candidate)
    return tempfile.TemporaryDirectory()


def file_system(path: str | Path) -> str | None:
    """The type of the file system `path` is on, as the lease decides it (its device's mount)."""
    return leased.file_system(os.stat(path).st_dev)


def viewing_file(tensors: list[torch.Tensor], path: Path) -> int:
    """How many of `tensors` have their bytes in a mapping of `path` (a leased host tier before any break)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return sum(any(start <= t.data_ptr() < end for start, end in spans) for t in tensors if t.numel())


def rewrite(path: Path) -> float:
    """Overwrite `path` in place with zeros, as an editor saving over it would; the seconds the open for writing
    was held (by a lease break: the model's mapped bytes are copied first)."""
    size = path.stat().st_size
    start = time.perf_counter()
    with open(path, "r+b") as handle:
        held = time.perf_counter() - start
        for offset in range(0, size, 64 << 20):
            handle.write(bytes(min(64 << 20, size - offset)))
    return held
