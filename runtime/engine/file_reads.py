"""A tree's reads from the file tier (`file_tier`): staging buffers, read-ahead, checked reads.

A fetch reads a unit's tensors through the checkpoint's checked reads (handed in as `FileSource.range`: this stage
imports no reader) into a staging buffer the tree reuses once nothing holds it any more. While one unit computes,
reader threads read the units that came next in the last forward, so a forward whose weights come from the file runs
near the disk's read rate.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..host_memory import return_large_frees
from .file_tier import FileSource, in_file, tensors_in_file


def _use_count(tensor: Tensor) -> int:
    """How many references `tensor`'s storage has (torch's own count: views, and the storage object this call
    makes); compared only with the same call's count when the buffer was new."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class FileTier:
    """A tree's reads of its file-tier tensors: staging buffers and read-ahead.

    Staging is a pool of `slabs` arenas the size of the largest unit read (what the load's tiers counted). While a
    unit computes, the units that followed it in the last forward are read, in order, into the arenas' free ends,
    so a forward of many small units keeps the disk busy. An arena starts over only once no tensor views it any more
    (torch's storage use count): a weight that model code or autograd keeps past its forward keeps its values, and a
    read that finds the pool full takes a fresh buffer outside it.
    """

    SLABS = 2
    """Staging, in multiples of the largest unit read from the file: the unit computing, and room to read ahead. One
    where memory is too short for two: then nothing is read ahead."""
    READERS = 2
    """Threads reading ahead: the units that fit the staging are read at once, more requests in flight on a disk
    than one thread keeps (each read opens its own descriptor)."""

    def __init__(self, slabs: int = SLABS, largest: int = 0) -> None:
        self.slabs = slabs
        self.read_ahead = slabs > 1
        self._pool: list[_Arena] = []
        self._largest = largest
        self._after: dict[int, weakref.ref] = {}
        """The unit read after each one last time (the forward's order, as it is now)."""
        self._last: int | None = None
        self._ahead: dict[int, _Pending] = {}
        self._rows: dict[int, tuple[FileSource, list[tuple[int, int]]]] = {}
        """What each unit read by chunks of rows read last time: its weight's source and its chunks, in order."""
        self._rows_ahead: dict[int, list[_Pending]] = {}
        """The reads of a unit's first chunks, started ahead of its turn (`follow`), in order."""
        self._advised: set[int] = set()
        """Units the kernel was asked to read ahead since they were last read."""
        self._current: tuple[int, dict[str, Tensor]] | None = None
        self._lock = threading.Lock()
        self._reader: queue.SimpleQueue | None = None
        self._outside_graphs = False
        self.pinned = False
        """Whether the arenas are pinned memory, which a GPU copies from asynchronously: set by a host that streams
        the tree to one (`offload`); a copy from pageable memory waits for the host instead."""

    def __reduce__(self):
        """A copied or unpickled tree reads its file through staging of its own (the bookkeeping, the reader thread
        and the lock here are this tree's)."""
        return FileTier, (self.slabs, self._largest)

    @property
    def staging_bytes(self) -> int:
        """Bytes the pool holds now (at most `slabs` times the largest unit read)."""
        return sum(arena.buffer.numel() for arena in self._pool)

    @property
    def largest(self) -> int:
        """The bytes of an arena: the largest unit read whole so far, at least what the load planned."""
        return self._largest

    def read_rows(self, source: FileSource, runs: list[tuple[int, int]], *, pooled: bool = True) -> Tensor:
        """Rows [start, stop) of `source`'s 2-D tensor for each of `runs`, one after another, in the model's dtype,
        read through its file's checked reads: into an arena's free end where they fit in one, else (and with
        `pooled=False`) into memory of their own, once what was read ahead of other units has given its staging back
        (their order changed). Never grows the arenas: rows are read to spare staging (`row_reads`)."""
        buffer = None
        if pooled:
            buffer = self._buffer(_rows_bytes(source, runs), pooled=True, grow=False)
            if buffer is None and (self._ahead or self._rows_ahead):  # read ahead out of this order: give it back
                self._drop_read_ahead()
                buffer = self._buffer(_rows_bytes(source, runs), pooled=True, grow=False)
        if buffer is None:
            buffer = torch.empty(_rows_bytes(source, runs), dtype=torch.uint8)
        return _read_rows(source, runs, buffer)

    def read_rows_ahead(self, source: FileSource, runs: list[tuple[int, int]]) -> _Pending | None:
        """`read_rows(source, runs)` started on a reader thread into an arena's free end, for the forward to take
        once it needs them; None where nothing is read ahead or no arena has room (the caller reads them itself)."""
        if not self.read_ahead:
            return None
        buffer = self._buffer(_rows_bytes(source, runs), pooled=True, grow=False)
        if buffer is None:
            return None
        pending = _Pending(functools.partial(_read_rows, source, runs, buffer))
        del buffer
        self._readers().put(pending)
        return pending

    def read(self, module: nn.Module) -> dict[str, Tensor]:
        """`module`'s file-tier tensors, read now or taken from the read ahead; then the next units' reads start."""
        key, current = id(module), self._current  # once: another thread's forward may replace it meanwhile
        if current is not None and current[0] == key:
            return current[1]
        del current  # the unit before is done: neither this frame nor the tier may keep its staging from reuse
        self._entering(module)
        self._advised.discard(key)
        pending = self._ahead.pop(key, None)
        if pending is not None:
            tensors = pending.taken()
        else:
            buffer = self._buffer(_unit_bytes(module), pooled=True)
            if buffer is None:  # what was read ahead, out of this order, holds the staging: give it back first
                self._drop_read_ahead()
                buffer = self._buffer(_unit_bytes(module), pooled=False)
            tensors = self._read_unit(module, buffer)
            del buffer
        self._current = (key, tensors)
        self.follow(module)
        return tensors

    def rows_in_turn(self, module: nn.Module, source: FileSource, chunks: list[tuple[int, int]]) -> list[_Pending]:
        """`module` starts reading `source` by `chunks` of rows (`row_reads`): it takes its turn in the forward's
        order, so the unit before it reads it ahead next time, as it does whole units; returns the reads of its first
        chunks started ahead of it, in order (none where its source or chunks differ from last time's)."""
        self._entering(module)
        started = self._rows_ahead.pop(id(module), [])
        last_source, last_chunks = self._rows.get(id(module), (None, None))
        if last_source is not source or last_chunks != chunks:  # not what was read ahead (the staging grew since,
            for pending in started:  # or another module has this one's id): what they read is not used
                pending.done.wait()
            started = []
        elif not started:  # its turn was learnt, yet nothing was read ahead for it: the forward left the order (a call
            self._drop_rows_ahead()  # of the base model, skipping the head), what other units' reads hold goes back
        self._rows[id(module)] = (source, chunks)
        return started

    def _entering(self, module: nn.Module) -> None:
        """`module` reads now: the unit before is done, and `module` follows it in the forward's order."""
        self.done_with_current()
        if self._last is not None:
            self._after[self._last] = weakref.ref(module)
        self._last = id(module)

    def done_with_current(self) -> None:
        """The unit read last is done (another computes now): the tier keeps its tensors no longer, so its staging
        starts over once nothing else views it."""
        self._current = None

    def read_outside_graphs(self) -> None:
        """From now on a compiled block breaks its graph at each read from the file, which runs eagerly and hands
        the graph its tensors: a graph can neither read a file nor keep this tier's bookkeeping (traced, it computed
        with another unit's weights)."""
        if not self._outside_graphs:
            self._outside_graphs = True
            self.read = torch.compiler.disable(self.read)

    def drop_staging(self) -> None:
        """Let the staging arenas go, and what was read ahead (the tree does not run for now; a read makes new ones)."""
        self.forget()
        with self._lock:
            self._pool = []

    def forget(self) -> None:
        """Drop what was read ahead and the order learnt (the tree was placed anew)."""
        self._drop_read_ahead()
        self._current = None
        self._advised.clear()
        self._after.clear()
        self._rows.clear()
        self._last = None

    def follow(self, module: nn.Module) -> None:
        """Start reading the units after `module` (which needs no more staging of its own) in the forward's order
        while the pool has room (of a unit read by chunks of rows, its chunks from the first), and ask the kernel to
        read the units after those into its page cache meanwhile, as many bytes as the pool holds (more requests in
        flight on the disk while the reader thread waits on its own; page cache the kernel drops first under memory
        pressure)."""
        if not self.read_ahead or torch.compiler.is_compiling():
            return
        past_pool: int | None = None  # bytes past a full pool, as far as the kernel is asked to read
        following, seen = module, {id(module)}
        while (link := self._after.get(id(following))) is not None and (following := link()) is not None \
                and id(following) not in seen:
            seen.add(id(following))
            if id(following) in self._rows:  # read by chunks, from the first: never advised whole (slower, tried)
                if past_pool is None:
                    past_pool = None if self._start_rows(following) else 0
                    continue
                past_pool += _unit_bytes(following)  # counted past the pool too, so the walk ends as for any unit
                if past_pool > self.slabs * self._largest:
                    return
                continue
            if id(following) in self._ahead or not in_file(following):
                continue
            nbytes = _unit_bytes(following)  # a unit larger than the arenas is never read ahead whole
            buffer = None if past_pool is not None else self._buffer(nbytes, pooled=True, grow=False)
            if buffer is None:  # the pool is full: the reader goes on at a later fetch, the kernel meanwhile
                past_pool = (past_pool or 0) + nbytes
                if past_pool > self.slabs * self._largest:
                    return
                if id(following) not in self._advised:  # once until it is read: no system calls each fetch
                    self._advised.add(id(following))
                    _advise(following)
                continue
            pending = self._ahead[id(following)] = _Pending(functools.partial(self._read_unit, following, buffer))
            self._readers().put(pending)
            del buffer, pending

    def _start_rows(self, module: nn.Module) -> bool:
        """Start reading `module`'s chunks of rows as they were last time, from the first not started yet, while the
        pool has room; whether every one is started."""
        source, chunks = self._rows[id(module)]
        started = self._rows_ahead.get(id(module), [])
        while len(started) < len(chunks) and (pending := self.read_rows_ahead(source, [chunks[len(started)]])):
            started.append(pending)
        if started:
            self._rows_ahead[id(module)] = started
        return len(started) == len(chunks)

    def _readers(self) -> queue.SimpleQueue:
        """The reader threads' queue, the threads started at the first read ahead."""
        if self._reader is None:
            self._reader = queue.SimpleQueue()
            threads = [threading.Thread(target=_read_ahead, args=(self._reader,), name=f"streamwise-read-ahead-{index}",
                                        daemon=True) for index in range(self.READERS)]
            for thread in threads:
                thread.start()
            weakref.finalize(self, _stop_readers, self._reader, threads)  # with the tier, or at the interpreter's exit
        return self._reader

    def _drop_read_ahead(self) -> None:
        """Wait for the reads ahead under way and let their staging go (nothing else holds it)."""
        ahead, self._ahead = self._ahead, {}
        for pending in ahead.values():
            pending.done.wait()
        ahead.clear()
        self._drop_rows_ahead()

    def _drop_rows_ahead(self) -> None:
        """Wait for the reads of units' first chunks under way and let their staging go."""
        rows, self._rows_ahead = self._rows_ahead, {}
        for started in rows.values():
            for pending in started:
                pending.done.wait()
        rows.clear()

    @staticmethod
    def _read_unit(module: nn.Module, buffer: Tensor) -> dict[str, Tensor]:
        found = tensors_in_file(module)
        raws, start = [], 0
        for _, source in found:
            raws.append(buffer[start:start + source.range.nbytes])
            start += source.range.nbytes
        for file, ranges in _by_file(found, raws).items():
            file.read_into(ranges)
        return {name: source.as_model_tensor(raw) for (name, source), raw in zip(found, raws, strict=True)}

    def _buffer(self, nbytes: int, *, pooled: bool, grow: bool = True) -> Tensor | None:
        """A uint8 buffer of `nbytes` no tensor views: the free end of an arena of the pool (an arena whose views
        are all gone starts over), else a new arena where the pool has room; else, unless `pooled`, a fresh buffer
        outside the pool. Arenas grow to the largest read, unless not to `grow` (then a larger read finds none)."""
        with self._lock:
            if not grow and nbytes > self._largest:
                return None
            self._largest = max(self._largest, nbytes, 1)
            for arena in self._pool:
                if _use_count(arena.buffer) == arena.idle:
                    arena.used = 0
            self._pool = [arena for arena in self._pool  # an idle arena smaller than the largest unit fragments
                          if arena.used or arena.buffer.numel() >= self._largest]
            for arena in self._pool:
                if arena.buffer.numel() - arena.used >= nbytes:
                    arena.used += nbytes
                    return arena.buffer[arena.used - nbytes:arena.used]
            if len(self._pool) < self.slabs:
                return_large_frees()  # staging: the process is short of memory, what its forwards free must go back
                fresh = torch.empty(self._largest, dtype=torch.uint8, pin_memory=self.pinned)
                self._pool.append(_Arena(fresh, _use_count(fresh), nbytes))  # the count while only the pool holds it
                return fresh[:nbytes]
            return None if pooled else torch.empty(nbytes, dtype=torch.uint8)


class _Pending:
    """A read ahead (a unit's tensors, or rows). What it holds (the read with its module and buffer, what was read)
    is let go as soon as it is used, so an arena is free exactly when nothing computes with what was read into it."""

    def __init__(self, read: Callable[[], object]) -> None:
        self.read: Callable[[], object] | None = read
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def taken(self):
        """What was read (or the read's error), waiting for the read; this object keeps nothing of it."""
        self.done.wait()
        result, error, self.result, self.error = self.result, self.error, None, None
        if error is not None:
            raise error
        return result


def _by_file(found: list[tuple[str, FileSource]], values: list) -> dict[object, list[tuple[int, object]]]:
    """Each file of `found`'s sources, with (offset, value) for its tensors: one call to the file per unit."""
    grouped: dict[object, list[tuple[int, object]]] = {}
    for (_, source), value in zip(found, values, strict=True):
        grouped.setdefault(source.range.file, []).append((source.range.offset, value))
    return grouped


def _advise(module: nn.Module) -> None:
    """Tell each file `module`'s file-tier tensors are in that their ranges will be read soon."""
    found = tensors_in_file(module)
    for file, spans in _by_file(found, [source.range.nbytes for _, source in found]).items():
        file.advise(spans)


def _stop_readers(reads: queue.SimpleQueue, threads: list[threading.Thread]) -> None:
    """End the reader threads once each has finished the read it is doing (a second at most is waited for each). At
    the interpreter's exit this runs before it finalizes: a daemon thread still inside a read then (a torch call that
    let go of the interpreter's lock) would be ended as it takes the lock back, which C++ code cannot unwind through:
    the process aborted ("terminate called without an active exception") after its work was done."""
    for _ in threads:
        reads.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=1.0)


def _read_ahead(reads: queue.SimpleQueue) -> None:
    """A reader thread: does each read put in `reads` until a None comes."""
    while (pending := reads.get()) is not None:
        try:
            pending.result = pending.read()
        except BaseException as exc:  # the forward that takes it raises it
            pending.error = exc
        finally:
            pending.read = None
            pending.done.set()
        del pending


def _rows_bytes(source: FileSource, runs: list[tuple[int, int]]) -> int:
    return sum(stop - start for start, stop in runs) * (source.range.nbytes // source.range.shape[0])


def _read_rows(source: FileSource, runs: list[tuple[int, int]], buffer: Tensor) -> Tensor:
    """`runs`' rows of `source` read into `buffer`, one after another, in the model's dtype."""
    row = source.range.nbytes // source.range.shape[0]
    ranges, at = [], 0
    for start, stop in runs:
        ranges.append((source.range.offset + start * row, buffer[at:at + (stop - start) * row]))
        at += (stop - start) * row
    if ranges:
        source.range.file.read_into(ranges)
    values = buffer.view(source.range.dtype).reshape(at // row, *source.range.shape[1:])
    return values if values.dtype == source.dtype else values.to(source.dtype)


@dataclass
class _Arena:
    """A staging buffer units are read into one after another; it starts over once nothing views it."""

    buffer: Tensor
    idle: int
    """Its storage's use count while only the pool holds it."""
    used: int


def _unit_bytes(module: nn.Module) -> int:
    """Bytes a read of `module`'s file-tier tensors takes (as stored in the file)."""
    return sum(source.range.nbytes for _, source in tensors_in_file(module))
