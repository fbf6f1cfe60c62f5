"""Where a load puts each tensor: host memory, or left in its file (the file tier), within a host budget.

The host budget follows accelerate's `max_memory["cpu"]`: given, or by default what this process can still allocate
(`host_memory`: the smallest cgroup limit up its tree, reclaimable page cache counted, else `MemAvailable`) less
`HOST_MARGIN` of the ceiling, kept for activations, the KV cache, the allocator's slack and whatever else the process
loads later. Tensors that must be in memory come first: everything outside a streamed unit, tied tensors, and values
the load transformed (dequantized, reordered); then whole streamed units in the plan's order while they fit; the rest
stays in the file and is read at each fetch into staging buffers (`engine.file_reads`), which the budget counts too. A
budget that cannot hold what must be in memory is refused before anything is read, with both figures and the budget
to set.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..engine.file_reads import FileTier
from ..engine.file_tier import FileSource
from ..engine.row_reads import RowReads, staging_bytes
from ..host_memory import HostMemoryError, host_memory
from ..sizes import SizeError, human, parse_size
from .errors import CheckpointError
from .leased import map_ranges
from .writers import refuse_mapped_for_writing

CHUNK = 64 << 20
"""Bytes one read of a load copies at most: large enough for the disk's sequential rate, small enough to spread."""
READERS = 4
"""Threads a load reads with at most."""
HOST_MARGIN = 0.10
"""The share of the host's memory ceiling (a cgroup limit, else the machine's RAM) the default host budget leaves
free: activations, the KV cache, the allocator's slack, and a later model in the same process."""


class HostBudgetError(CheckpointError):
    """What a load or placing must hold does not fit the host budget: refused before anything is read or moved."""


SHORT_MARGIN = 12 << 20
"""What a load short of memory leaves free at least for the forward (activations, the KV cache of a short prompt,
torch's and the allocator's slack), where `HOST_MARGIN` of the ceiling leaves too little for what must be in memory:
twice what a 156 M-parameter Qwen2 generating from a 16-token prompt needed (killed with 4 MiB free beside its
staging, ran with 7: `benchmarks/bench_headroom.py`)."""


@dataclass(frozen=True)
class HostBudget:
    bytes: int | None
    """None: no limit (everything the load reads stays in memory)."""
    why: str
    short: HostBudget | None = None
    """Where memory is short, the budget that leaves only `SHORT_MARGIN` free (`"auto"` budgets)."""


def host_budget(max_memory: object) -> HostBudget:
    """The host budget of `max_memory`: None or `"auto"` (what the process can spare, less `HOST_MARGIN`), a size,
    or accelerate's dict whose `"cpu"` entry is the host budget (`"disk"` needs no entry: the checkpoint is the
    disk tier); a dict without `"cpu"` leaves host memory unlimited."""
    if isinstance(max_memory, dict):
        if "cpu" not in max_memory:
            return HostBudget(None, "max_memory names no \"cpu\" budget")
        max_memory = max_memory["cpu"]
    if max_memory is None or (isinstance(max_memory, str) and max_memory.strip().lower() == "auto"):
        try:
            memory = host_memory()
        except HostMemoryError as exc:
            raise CheckpointError([f"{exc}: pass max_memory={{'cpu': '8GiB'}}"]) from None
        spare = max(0, memory.available - int(HOST_MARGIN * memory.total))
        least = max(0, memory.available - SHORT_MARGIN)
        short = HostBudget(least, f"{human(least)}: {human(memory.available)} available less {human(SHORT_MARGIN)}, "
                                  f"short of memory ({memory.source})") if least > spare else None
        return HostBudget(spare, f"{human(spare)}: {human(memory.available)} available less {HOST_MARGIN:.0%} of "
                                 f"{human(memory.total)} ({memory.source})", short)
    try:
        size = parse_size(max_memory, "max_memory['cpu']")
    except SizeError as exc:
        raise CheckpointError([f"{exc}; or 'auto' (what this process can spare)"]) from None
    try:
        spare = host_budget("auto")
    except CheckpointError:  # no figure of the host's memory here: the budget given is all there is to go by
        spare = None
    if spare is not None and spare.bytes < size:  # a budget is a most, never more than the memory there is
        return HostBudget(spare.bytes, f"{spare.why}, less than the {human(size)} given (max_memory['cpu'])",
                          spare.short)
    return HostBudget(size, f"{human(size)}, as given (max_memory['cpu'])")


@dataclass
class Unit:
    """A streamed unit's tensors as the load holds them: (key, value) where a value is read from the file
    (`FileSource`) or was made in memory (a tensor); how its leaves read their weight from the file (`reads`, by
    rows or whole); and the other leaves it holds, that share a tensor with it (`also`: a tied embedding and head)."""

    path: str
    values: list[tuple[str, object]]
    reads: RowReads | None = None
    also: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(_nbytes(value) for _, value in self.values)

    @property
    def staging(self) -> int:
        """The staging it needs while in the file: all of it, chunks of rows, or none (rows it gathers)."""
        ranges = [value.range for _, value in self.values if isinstance(value, FileSource)]
        row = max((stored.nbytes // stored.shape[0] for stored in ranges if len(stored.shape) == 2), default=0)
        return staging_bytes(self.reads, sum(stored.nbytes for stored in ranges), row)

    @property
    def can_stay_in_file(self) -> bool:
        return all(isinstance(value, FileSource) for _, value in self.values)


@dataclass(frozen=True)
class Tiers:
    """What a load keeps in memory and what stays in the file."""

    in_file: frozenset[str]
    """The keys whose values stay in their file."""
    host_bytes: int
    file_bytes: int
    file_units: int
    staging_bytes: int
    budget: int | None
    """The host budget, kept by the tree for a later `offload`."""
    slabs: int = FileTier.SLABS
    """Staging buffers for the file tier (one: memory is too short to read ahead)."""
    working_bytes: int = 0
    """Kept free for a forward's expansion of quantized weights (`quant.residents.expansion_bytes`)."""

    @property
    def tight(self) -> bool:
        """Memory is short: the page cache of what is copied into memory is dropped, so a memory limit does not
        charge those bytes twice (a warm load after a tight one reads from the disk again)."""
        return self.file_bytes > 0 or (self.budget is not None and 2 * self.host_bytes > self.budget)

    def __str__(self) -> str:
        ahead = "" if self.slabs > 1 else ", no read-ahead"
        working = f", +{human(self.working_bytes)} expanding quantized weights" if self.working_bytes else ""
        return (f"host memory {human(self.host_bytes)}, file {human(self.file_bytes)} in {self.file_units} units "
                f"(+{human(self.staging_bytes)} staging{ahead}{working})")


def place(path: str, must_hold: Iterable[object], units: list[Unit], budget: HostBudget, *,
          file_tier: bool = True, slabs: int = FileTier.SLABS, doing: str = "loading", working: int = 0) -> Tiers:
    """What stays in memory and what in the file, the fewest bytes in the file that fit `budget` after `must_hold`:
    two staging buffers (read-ahead), else one; each sized for the largest staging a unit left in the file needs (a
    unit read by rows needs a chunk or none: `row_reads`), so every size of that unit is tried (a large unit kept in
    memory can leave far more of the rest there). A host that cannot
    read from files (`file_tier=False`) keeps all in memory; `slabs` is the most staging buffers there may be (a
    tree placed anew keeps the ones it has); `working` bytes stay free for the forward (expanding quantized weights).
    Nothing fits: within the budget's short one where it has one (`"auto"`: only `SHORT_MARGIN` left free), every
    unit that can stay in the file there, so that what memory is left is the forward's; else a HostBudgetError saying
    what `doing` needs, what the budget is and which budget to set. A file a process maps for writing keeps none
    (`writers`): a CheckpointError says so."""
    try:
        placed = _place(path, must_hold, units, budget, file_tier, slabs, doing, working)
    except HostBudgetError:
        if budget.short is None:
            raise
        placed = _place(path, must_hold, units, budget.short, file_tier, slabs, doing, working, fill=False)
    if placed.in_file:  # never in a file a process maps for writing: the file tier could not see its changes
        files = {id(value.range.file): value.range.file  # (none where only the figures are placed)
                 for unit in units for key, value in unit.values if key in placed.in_file and value.range.file}
        refuse_mapped_for_writing(list(files.values()),
                                  human(placed.host_bytes + placed.file_bytes + placed.working_bytes))
    return placed


def _place(path: str, must_hold: Iterable[object], units: list[Unit], budget: HostBudget, file_tier: bool, slabs: int,
           doing: str, working: int, fill: bool = True) -> Tiers:
    room = HostBudget(None if budget.bytes is None else budget.bytes - working, budget.why)  # what weights may take
    fixed = sum(_nbytes(value) for value in must_hold)
    movable = [unit for unit in units if file_tier and unit.can_stay_in_file]
    # every arena size a unit may ask for: itself whole (read ahead of its turn), or the least it reads by rows in
    caps = sorted({size for unit in movable for size in (unit.bytes, unit.staging)}, reverse=True) or [0]
    for buffers in range(slabs, 0, -1):
        fitting = [tiers for cap in caps
                   if _fits(tiers := _placed(fixed, units, movable, room, buffers, cap, fill), room)]
        if fitting:
            return replace(min(fitting, key=lambda tiers: tiers.file_bytes), budget=budget.bytes, working_bytes=working)
    kept = sum(unit.bytes for unit in units) - sum(unit.bytes for unit in movable)
    kept_why = ("of streamed units this host keeps in memory (it reads no weight from files)" if not file_tier
                else "of units whose values were transformed on load")
    staging = max((unit.staging for unit in movable), default=0)  # everything in the file, read as sparingly as can be
    expanding = f", and {human(working)} to expand the largest quantized weight at each call" if working else ""
    raise HostBudgetError([
        f"{path}: {doing} needs at least {human(fixed + kept + staging + working)} of host memory, but the host budget "
        f"is {budget.why}. In memory must be {human(fixed)} of tensors outside streamed units (tied or transformed "
        f"ones too), {human(kept)} {kept_why}, {human(staging)} for a staging buffer of the largest unit left in the "
        f"file{expanding}. Free memory or raise the memory limit, raise the host budget, or use a policy that streams "
        "more of the model"])


def _fits(tiers: Tiers, budget: HostBudget) -> bool:
    return budget.bytes is None or tiers.host_bytes + tiers.staging_bytes <= budget.bytes


def _placed(fixed: int, units: list[Unit], movable: list[Unit], budget: HostBudget, slabs: int, cap: int,
            fill: bool = True) -> Tiers:
    """Units in memory in order while they fit beside `slabs` staging buffers of `cap` bytes (none, unless `fill`);
    the rest in the file, except units needing more staging than `cap` (and those that cannot stay in the file),
    which are in memory whatever it costs."""
    can_move = {id(unit) for unit in movable if unit.staging <= cap}
    host = fixed + sum(unit.bytes for unit in units if id(unit) not in can_move)  # first: they come what may
    in_file, file_bytes, file_units, largest = set(), 0, 0, 0
    for unit in units:
        size = unit.bytes
        if id(unit) not in can_move:
            continue
        if budget.bytes is None or (fill and host + size + slabs * cap <= budget.bytes):
            host += size
        else:
            in_file.update(key for key, _ in unit.values)  # whole where it fits the arena, else by rows
            file_bytes, file_units = file_bytes + size, file_units + 1
            largest = max(largest, unit.staging, min(size, cap) if unit.reads != "gather" else 0)
    return Tiers(frozenset(in_file), host, file_bytes, file_units, slabs * largest, budget.bytes, slabs)


def read_in(sources: list[FileSource], *, drop_cache: bool) -> list[Tensor]:
    """Each source's tensor in host memory: where a lease keeps its file as it is (`leased`), the file's own bytes
    in the page cache, mapped; else read into memory of its own, in chunks of `CHUNK` bytes spread over a few threads
    (the copy out of the page cache is most of a warm load, and reads release the GIL); any CheckpointError raised
    as is."""
    raws: list[Tensor | None] = [None] * len(sources)
    mappable: dict[int, tuple[object, list[int]]] = {}
    for index, source in enumerate(sources):
        if _stored_as_is(source):
            mappable.setdefault(id(source.range.file), (source.range.file, []))[1].append(index)
    for file, indexes in mappable.values():
        views = map_ranges(file, [(sources[index].range.offset, sources[index].range.nbytes) for index in indexes])
        if views is not None:
            for index, view in zip(indexes, views, strict=True):
                raws[index] = view
    copied = [index for index, raw in enumerate(raws) if raw is None]
    for index in copied:
        raws[index] = torch.empty(sources[index].range.nbytes, dtype=torch.uint8)
    batches: list[tuple[object, list[tuple[int, Tensor]]]] = []
    size = CHUNK
    for index in copied:
        source, raw = sources[index], raws[index]
        for start in range(0, source.range.nbytes, CHUNK):
            piece = raw[start:start + CHUNK]
            if size + piece.numel() > CHUNK or batches[-1][0] is not source.range.file:
                batches.append((source.range.file, []))
                size = 0
            batches[-1][1].append((source.range.offset + start, piece))
            size += piece.numel()
    workers = min(READERS, len(batches), os.cpu_count() or 1)
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="streamwise-load") as pool:
            for _ in pool.map(lambda batch: batch[0].read_into(batch[1], drop_cache=drop_cache), batches):
                pass
    else:
        for file, ranges in batches:
            file.read_into(ranges, drop_cache=drop_cache)
    return [source.as_model_tensor(raw) for source, raw in zip(sources, raws, strict=True)]


def _stored_as_is(source: FileSource) -> bool:
    """Whether the model takes the file's bytes as they are, aligned for their dtype: then they can be mapped."""
    return source.uncast and source.range.nbytes > 0 and source.range.offset % source.range.dtype.itemsize == 0


def _nbytes(value: object) -> int:
    return value.nbytes  # a FileSource's in the model's dtype; a tensor's own
