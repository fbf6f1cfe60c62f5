"""The file tier: weights that stay in their checkpoint file until their unit is fetched.

A tensor on the file tier is a `FileTensor`: a stand-in (`stand_in`) of its dtype and shape on the host, so model
code reading `.dtype` or `.shape` sees the real ones and a direct read (`F.linear(x, m.weight)`) reads its values from
the file; its `FileSource` is also recorded on its module (`protocol.SOURCES`). A fetch reads a unit's tensors
through the checkpoint's checked reads (handed in as `FileSource.range`: this stage imports no reader) into a staging
buffer the tree reuses once nothing holds it any more. While one unit computes, reader threads read the units that
came next in the last forward, so a forward whose weights come from the file runs near the disk's read rate. A file
changed under the model is the reader's `CheckpointError` at the fetch that reads it, never a signal: nothing of the
file is mapped.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from ..host_memory import return_large_frees
from . import protocol
from .stand_in import StandIn, applied_dtype

if TYPE_CHECKING:  # the journal moves tensors through `tree`, which reads through this module
    from .journal import Journal


class FileRange(Protocol):
    """A tensor's bytes in a checked file (the checkpoint stage's `FileRange`)."""

    file: object  # has read_into(ranges), advise(spans) and verify(): the checkpoint stage's CheckedFile
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileSource:
    """Where a tensor of the model can be read back from: its file range, and the dtype and shape it has in the
    model (a float cast at the fetch where they differ from the file's; uint8 is a resident's raw storage)."""

    range: FileRange
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The bytes it takes in memory, in the model's dtype."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def uncast(self) -> bool:
        """Whether the model's tensor is the file's bytes as they are: its dtype, or a resident's raw storage."""
        return self.dtype == self.range.dtype or self.dtype == torch.uint8

    def as_model_tensor(self, raw: Tensor) -> Tensor:
        """The model's tensor from the range's raw bytes (`raw`, uint8)."""
        if self.dtype == torch.uint8 and self.range.dtype != torch.uint8:  # a resident keeps the raw storage
            return raw.reshape(self.shape)
        values = raw.view(self.range.dtype).reshape(self.range.shape)
        return values if values.dtype == self.dtype else values.to(self.dtype)

    def read(self) -> Tensor:
        """The model's tensor, read from the file into memory of its own."""
        raw = torch.empty(self.range.nbytes, dtype=torch.uint8)
        self.range.file.read_into([(self.range.offset, raw)])
        return self.as_model_tensor(raw)

    def placeholder(self, like: Tensor) -> Tensor:
        """What the module holds in place of `like` while it is on the file tier: its `FileTensor`, a Parameter
        where `like` is one."""
        tensor = FileTensor(self)
        if isinstance(like, nn.Parameter):
            return nn.Parameter(tensor, requires_grad=like.requires_grad)
        return tensor


class FileTensor(StandIn):
    """A tensor on the file tier as model code sees it: its model dtype and shape, on the host."""

    @staticmethod
    def __new__(cls, source: FileSource):
        tensor = StandIn.__new__(cls, source.shape, source.dtype, "cpu")
        tensor.source = source
        return tensor

    def values(self, device: torch.device | None) -> Tensor:
        value = self.source.read()  # the checked read: a changed file is a CheckpointError naming it
        return value if device is None else value.to(device)

    def alias(self) -> FileTensor:
        return FileTensor(self.source)

    def describe(self) -> str:
        return f"in the file tier ({self.source.range.file.path}, at byte {self.source.range.offset})"

    def remedy(self) -> str:
        return "load the weights into memory first (a host budget that holds them)"


def in_memory(tensor: Tensor) -> bool:
    """Whether `tensor` holds values in memory: neither on the file tier nor on `meta`."""
    return not tensor.is_meta and not isinstance(tensor, FileTensor)


@dataclass(frozen=True)
class Sources:
    """What `protocol.SOURCES` holds on a module: its tensors that can go back to their file, and the tree's reads
    (a generic container's claimed descendants are no converted modules, yet read through it)."""

    tier: FileTier
    tensors: dict[str, FileSource]


def read_back(module: nn.Module, name: str, read: dict[int, Tensor] | None = None) -> Tensor:
    """The value of a file-tier tensor, read into memory of its own (a Parameter where its placeholder is one).
    `read`: what one placing read back so far, by placeholder: a tensor tied across modules (an embedding and its
    head share one placeholder) is read once and stays one tensor."""
    source, placeholder = sources(module)[name], module._parameters[name]
    if read is not None and id(placeholder) in read:
        return read[id(placeholder)]
    value = source.read()
    if isinstance(placeholder, nn.Parameter):
        value = nn.Parameter(value, requires_grad=placeholder.requires_grad)
    if read is not None:
        read[id(placeholder)] = value
    return value


def leave_in_file(journal: Journal, module: nn.Module, made: dict[int, Tensor] | None = None) -> None:
    """Put a module's tensors back in their file: each becomes its `FileTensor` (those there already stay). `made`:
    the placeholders one placing made so far, by the tensor they replace: a tensor tied across modules becomes one
    placeholder, still tied."""
    made = {} if made is None else made
    for name, source in sources(module).items():
        tensor = module._parameters.get(name)
        if tensor is not None and not isinstance(tensor, FileTensor):
            source.range.file.verify()  # a file changed since the load could not give the same values back
            placeholder = made.get(id(tensor))
            if placeholder is None:
                placeholder = made[id(tensor)] = source.placeholder(tensor)
            journal.set_tensor(module, name, placeholder)


def leave_tree_in_file(journal: Journal, model: nn.Module) -> int:
    """Put every streamed leaf of `model` whose tensors (and those it claims) can all be read back from their file
    there, fetching from then on: what a host does with a model it keeps but no longer runs, to give its host memory
    back (its tier's staging too: `FileTier.drop_staging`). The bytes given back."""
    given, made = 0, {}
    for leaf in model.modules():
        owners = [leaf, *protocol.claimed(leaf)]
        held = [(owner, name, tensor) for owner in owners for name, tensor in owner._parameters.items()
                if tensor is not None and in_memory(tensor)]
        if protocol.kind_of(leaf) is None or not held or any(name not in sources(owner) for owner, name, _ in held):
            continue
        fresh = {id(tensor): tensor for _, _, tensor in held if id(tensor) not in made}  # a tied one counts once
        for owner in owners:
            leave_in_file(journal, owner, made)
        journal.keep(leaf, (protocol.FETCH_FLAG,))
        protocol.set_fetching(leaf, True)
        given += sum(tensor.nbytes for tensor in fresh.values())
    return given


def sources(module: nn.Module) -> dict[str, FileSource]:
    """The tensors of `module` that can go back to their file, by attribute name."""
    record = module.__dict__.get(protocol.SOURCES)
    return record.tensors if record is not None else {}


def on_file_tier(module: nn.Module, name: str) -> bool:
    tensor = module._parameters.get(name, module._buffers.get(name))
    return isinstance(tensor, FileTensor) and name in sources(module)


def in_file(module: nn.Module) -> bool:
    """Whether some tensor of `module` (its own, not its children's) is on the file tier now."""
    record = module.__dict__.get(protocol.SOURCES)
    return record is not None and any(on_file_tier(module, name) for name in record.tensors)


@contextmanager
def kept_in_file(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Around torch's `_apply(fn)` of `module` (`.to()`, `.half()`, a host's device move): the file-tier
    placeholders of its subtree are set aside, so a device move neither reads a file nor fails on a meta tensor (a
    fetch brings them to the compute device); a dtype cast `fn` makes becomes their model dtype, applied at each
    fetch as a load's `dtype=` is."""
    aside = []
    for owner in module.modules():
        record = owner.__dict__.get(protocol.SOURCES)
        for name in (record.tensors if record is not None else ()):
            if on_file_tier(owner, name):
                held_in = owner._parameters if name in owner._parameters else owner._buffers
                aside.append((record, name, held_in, held_in[name]))
                held_in[name] = None  # `_apply` passes over a None
    try:
        yield
    finally:
        for record, name, held_in, placeholder in aside:
            source = record.tensors[name]
            dtype = applied_dtype(fn, source.dtype)
            if dtype != source.dtype:
                record.tensors[name] = source = dataclasses.replace(source, dtype=dtype)
                placeholder = source.placeholder(placeholder)
            held_in[name] = placeholder


def held(module: nn.Module, name: str) -> Tensor | None:
    """The tensor `name` of `module` as a fetch copies it: the one it holds, or, on the file tier, its bytes read
    from the file (`FileTier.read`)."""
    tensor = module._parameters[name] if name in module._parameters else getattr(module, name, None)
    if not isinstance(tensor, FileTensor):  # the parameter itself (a resident's `weight` attribute stands for it)
        return tensor
    record = module.__dict__.get(protocol.SOURCES)
    if record is None or name not in record.tensors:
        return tensor.values(None)  # not the tree's (a tensor assigned from another tree): read on its own
    return record.tier.read(module)[name]


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
        `pooled=False`) into memory of their own. Never grows the arenas: rows are read to spare staging
        (`row_reads`)."""
        row = source.range.nbytes // source.range.shape[0]
        count = sum(stop - start for start, stop in runs)
        buffer = self._buffer(count * row, pooled=True, grow=False) if pooled else None
        if buffer is None:
            buffer = torch.empty(count * row, dtype=torch.uint8)
        ranges, at = [], 0
        for start, stop in runs:
            ranges.append((source.range.offset + start * row, buffer[at:at + (stop - start) * row]))
            at += (stop - start) * row
        if ranges:
            source.range.file.read_into(ranges)
        values = buffer.view(source.range.dtype).reshape(count, *source.range.shape[1:])
        return values if values.dtype == source.dtype else values.to(source.dtype)

    def read(self, module: nn.Module) -> dict[str, Tensor]:
        """`module`'s file-tier tensors, read now or taken from the read ahead; then the next units' reads start."""
        key, current = id(module), self._current  # once: another thread's forward may replace it meanwhile
        if current is not None and current[0] == key:
            return current[1]
        del current  # the unit before is done: neither this frame nor the tier may keep its staging from reuse
        self._current = None
        if self._last is not None:
            self._after[self._last] = weakref.ref(module)
        self._last = key
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
        self._follow(module)
        return tensors

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
        self._last = None

    def _follow(self, module: nn.Module) -> None:
        """Start reading the units after `module` in the forward's order while the pool has room, and ask
        the kernel to read the units after those into its page cache meanwhile, as many bytes as the pool holds
        (more requests in flight on the disk while the reader thread waits on its own; page cache the kernel drops
        first under memory pressure)."""
        if not self.read_ahead or torch.compiler.is_compiling():
            return
        past_pool: int | None = None  # bytes past a full pool, as far as the kernel is asked to read
        following, seen = module, {id(module)}
        while (link := self._after.get(id(following))) is not None and (following := link()) is not None \
                and id(following) not in seen:
            seen.add(id(following))
            if id(following) in self._ahead or not in_file(following):
                continue
            nbytes = _unit_bytes(following)  # a unit larger than the arenas (read by rows) is never read ahead
            buffer = None if past_pool is not None else self._buffer(nbytes, pooled=True, grow=False)
            if buffer is None:  # the pool is full: the reader goes on at a later fetch, the kernel meanwhile
                past_pool = (past_pool or 0) + nbytes
                if past_pool > self.slabs * self._largest:
                    return
                if id(following) not in self._advised:  # once until it is read: no system calls each fetch
                    self._advised.add(id(following))
                    _advise(following)
                continue
            if self._reader is None:
                self._reader = queue.SimpleQueue()
                for index in range(self.READERS):
                    threading.Thread(target=_read_ahead, args=(self._reader,), name=f"streamwise-read-ahead-{index}",
                                     daemon=True).start()
                    weakref.finalize(self, self._reader.put, None)  # the threads end with the tier
            pending = self._ahead[id(following)] = _Pending(following, buffer)
            self._reader.put(pending)
            del buffer, pending

    def _drop_read_ahead(self) -> None:
        """Wait for the reads ahead under way and let their staging go (nothing else holds it)."""
        ahead, self._ahead = self._ahead, {}
        for pending in ahead.values():
            pending.done.wait()
        ahead.clear()

    @staticmethod
    def _read_unit(module: nn.Module, buffer: Tensor) -> dict[str, Tensor]:
        found = _in_file(module)
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
    """A unit being read ahead. What it holds (the module, the buffer, the tensors read) is let go as soon as it is
    used, so an arena is free exactly when nothing computes with what was read into it."""

    def __init__(self, module: nn.Module, buffer: Tensor) -> None:
        self.module: nn.Module | None = module
        self.buffer: Tensor | None = buffer
        self.tensors: dict[str, Tensor] | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def taken(self) -> dict[str, Tensor]:
        """The tensors read (or the read's error), waiting for the read; this object keeps nothing of them."""
        self.done.wait()
        tensors, error, self.tensors, self.error = self.tensors, self.error, None, None
        if error is not None:
            raise error
        return tensors


def _in_file(module: nn.Module) -> list[tuple[str, FileSource]]:
    """`module`'s tensors on the file tier, by name, with their sources."""
    return [(name, source) for name, source in sources(module).items() if on_file_tier(module, name)]


def _by_file(found: list[tuple[str, FileSource]], values: list) -> dict[object, list[tuple[int, object]]]:
    """Each file of `found`'s sources, with (offset, value) for its tensors: one call to the file per unit."""
    grouped: dict[object, list[tuple[int, object]]] = {}
    for (_, source), value in zip(found, values, strict=True):
        grouped.setdefault(source.range.file, []).append((source.range.offset, value))
    return grouped


def _advise(module: nn.Module) -> None:
    """Tell each file `module`'s file-tier tensors are in that their ranges will be read soon."""
    found = _in_file(module)
    for file, spans in _by_file(found, [source.range.nbytes for _, source in found]).items():
        file.advise(spans)


def _read_ahead(reads: queue.SimpleQueue) -> None:
    """A reader thread: reads each unit put in `reads` until a None comes."""
    while (pending := reads.get()) is not None:
        try:
            pending.tensors = FileTier._read_unit(pending.module, pending.buffer)
        except BaseException as exc:  # the forward that takes the unit raises it
            pending.error = exc
        finally:
            pending.module = pending.buffer = None
            pending.done.set()
        del pending


@dataclass
class _Arena:
    """A staging buffer units are read into one after another; it starts over once nothing views it."""

    buffer: Tensor
    idle: int
    """Its storage's use count while only the pool holds it."""
    used: int


def _unit_bytes(module: nn.Module) -> int:
    """Bytes a read of `module`'s file-tier tensors takes (as stored in the file)."""
    return sum(source.range.nbytes for _, source in _in_file(module))
