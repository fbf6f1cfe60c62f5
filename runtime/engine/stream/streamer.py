"""Streaming by units: one copy per unit into a ring of device slots, ahead of the compute, for every kind.

A fetch of any streamed leaf (a float leaf's weight and bias, a resident's raw storage, a generic container's
parameters and those it claims) enters the leaf's unit: the compute stream waits for the unit's copy, and the copy
stream starts on the units that follow, as many as the ring has slots besides this one (wrap-around: after the last
unit of a forward comes the first of the next). A slot is written again only after the compute stream has passed
every use of it: its "free" event is recorded when the next unit is entered, and the copy into it waits for that
event. The ring, its events and the units' layout are made when placing; a settled forward makes no device buffer,
event or stream, and no call that waits on the host.

A unit's tensors come from the host region they were packed into (`arena`): one copy where they still lie there
together, else one per tensor. Before a unit's copy is used, its tensors' addresses and in-place versions are
compared with those its copy was made from: a weight changed in place (a merged LoRA, an optimizer step) or replaced
(`.data =`, a new Parameter, `tie_weights()`) is copied again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .. import file_tier, protocol
from ..errors import EngineError
from ..journal import Journal
from ..tree import TorchFetcher
from . import arena
from .arena import padded
from .device import DeviceOps
from .measure import FirstForward, ForwardTimes, UnitTiming


class Unit:
    """The streamed leaves of one block (or a leaf outside every block) and the parameters their fetches read: their
    own, and those a generic container claims, each once."""

    def __init__(self, name: str, leaves: Sequence[nn.Module], block: nn.Module | None = None) -> None:
        self.name = name
        """The block's path (or the leaf's), for messages."""
        self.block = block
        """The block whose streamed leaves these are (None: a leaf outside every block)."""
        self.leaves = tuple(leaves)
        owners = {id(o): o for leaf in leaves for o in (leaf, *protocol.claimed(leaf))}
        self.owners = tuple(owners.values())
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for owner in self.owners:
            for name, tensor in owner._parameters.items():
                if tensor is not None:
                    holders.setdefault(id(tensor), []).append((owner, name))
        self.holders = list(holders.values())
        """Per tensor, each (module, name) holding it: a tensor tied within the unit is copied once."""
        tensors = self.tensors()
        self.nbytes = sum(padded(tensor.nbytes) for tensor in tensors)
        self.in_file = not all(file_tier.in_memory(tensor) for tensor in tensors)
        """Whether some of its tensors are on the file tier: the unit is copied from what its reads stage."""

    def tensors(self) -> list[Tensor]:
        """The unit's tensors as its modules hold them now."""
        return [owner._parameters[name] for (owner, name), *_ in self.holders]

    def stamp(self, tensors: list[Tensor] | None = None) -> tuple[tuple[int, int], ...]:
        """Where each tensor lies (a file-tier one: which stand-in) and its in-place version (of `tensors`, the
        unit's as held now, where given): a copy made from another stamp is stale."""
        return tuple((t.data_ptr() if file_tier.in_memory(t) else id(t), t._version)
                     for t in tensors or self.tensors())

    def host_range(self, tensors: list[Tensor] | None = None) -> Tensor | None:
        """The unit's bytes (`tensors`, the unit's as held now, where given) as one host range, where they lie one
        after another in one storage in the unit's order, each at the aligned end of the one before (as `arena.pack`
        lays them out); else None."""
        tensors = tensors or self.tensors()
        if self.in_file:
            return None
        storage = tensors[0].untyped_storage()
        start = tensors[0].data_ptr() - storage.data_ptr()
        expected = tensors[0].data_ptr()
        for tensor in tensors:
            if tensor.data_ptr() != expected or tensor.untyped_storage().data_ptr() != storage.data_ptr():
                return None
            expected += padded(tensor.nbytes)
        whole = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage)
        return whole[start:start + min(self.nbytes, storage.nbytes() - start)]


class _Slot:
    """One device buffer of the ring, the unit copied into it, and its two events."""

    def __init__(self, ops: DeviceOps, nbytes: int) -> None:
        self.buffer = ops.buffer(nbytes)
        self.copied = ops.event()  # recorded on the copy stream after the unit's copy
        self.free = ops.event()  # recorded on the compute stream once every use of the slot is queued
        self.unit: Unit | None = None
        self.stamp: tuple = ()
        self.views: dict[int, dict[str, Tensor]] = {}  # by module id: its tensors' views of the buffer
        self.staged: list[Tensor] = []  # what a file-tier unit's copy reads: kept from reuse until it is done


class UnitStreamer(TorchFetcher):
    """A tree's fetcher streaming `units` to `device` through a ring of `slots` device buffers (prefetch depth
    `slots - 1`); leaves in no unit (those reading their weight from the file by rows) fetch as plain torch does,
    waiting for each copy: their staging is reused as soon as nothing holds it."""

    SLOTS = 2
    """The ring's slots: prefetch depth 1 (a unit computes while the next is copied)."""

    def __init__(self, ops: DeviceOps, device: torch.device, units: Sequence[Unit], slots: int = SLOTS,
                 expansion: int = 0, clock: UnitTiming | None = None) -> None:
        self.ops, self.device, self.units = ops, device, tuple(units)
        self.expansion_buffer = ops.buffer(expansion) if expansion else None
        """The tree's reused expansion buffer on the device (`expansion`): made once, with the ring."""
        self.unit_of = {id(owner): unit for unit in self.units for owner in unit.owners}
        self.unit_of_block = {id(unit.block): unit for unit in self.units if unit.block is not None}
        size = max((unit.nbytes for unit in self.units), default=0)
        self.slots = [_Slot(ops, size) for _ in range(slots)] if self.units else []
        self.after = {id(unit): following for unit, following in zip(self.units, self.units[1:] + self.units[:1],
                                                                        strict=True)}
        """The unit entered after each last time (first guess: registration order, which wraps around)."""
        self.current: _Slot | None = None
        self.turn = 0
        self.on_host: Unit | None = None
        """The unit computing on the host now (`on_host`): its leaves read their host tensors, no copy."""
        self.retiring: list[tuple[object, list[Tensor]]] = []
        """File-tier staging copied into a slot written again since: held until that copy's event is done."""
        self.staging = any(unit.in_file for unit in self.units)
        """Whether some unit is copied from the file tier's staging, which `_release_staging` lets go."""
        self.timing: UnitTiming | None = clock or (FirstForward(ops, self.units) if self.units else None)
        """The first forward's timers, until its figures are read; or a measuring forward's `clock` (`measure`)."""
        self.measured: ForwardTimes | None = None
        """The first streamed forward against its floor, once read."""

    @staticmethod
    def ring_bytes(units: Sequence[Unit], slots: int = SLOTS) -> int:
        """Device bytes a ring for `units` takes."""
        return slots * max((unit.nbytes for unit in units), default=0)

    def fetch(self, module, device, dtype):
        views = self._views(module, device)
        if views is None:
            return super().fetch(module, device, dtype)
        return self.for_compute(module, views.get("weight"), views.get("bias"), device, dtype)

    def fetch_raw(self, module, names, device):
        views = self._views(module, device)
        return super().fetch_raw(module, names, device) if views is None else [views.get(name) for name in names]

    fetch_parameters = fetch_raw  # a generic container's parameters and those it claims: views of the same slot

    def expansion(self, nbytes, device):
        buffer = self.expansion_buffer
        return None if buffer is None or device != self.device or nbytes > buffer.numel() else buffer[:nbytes]

    @contextmanager
    def around_block(self, block: nn.Module) -> Iterator[None]:
        """Enter the unit of `block` before its compiled graph runs, and hand its modules their slot views for the
        graph to read as inputs (`protocol.VIEWS`); taken back after it, so nothing outlives the call."""
        unit = self.unit_of_block.get(id(block))
        if unit is None:
            yield
            return
        if self.current is None or self.current.unit is not unit:
            self._enter(unit)
        views = self.current.views
        for owner in unit.owners:
            owner.__dict__[protocol.VIEWS] = views[id(owner)]
        try:
            yield
        finally:
            for owner in unit.owners:
                owner.__dict__.pop(protocol.VIEWS, None)

    def _views(self, module: nn.Module, device: torch.device) -> dict[str, Tensor] | None:
        if torch.compiler.is_compiling():  # inside a compiled block: the views `around_block` handed over
            return getattr(module, protocol.VIEWS, None)
        unit = self.unit_of.get(id(module))
        if unit is None or device != self.device or unit is self.on_host:
            return None
        if self.current is None or self.current.unit is not unit:
            self._enter(unit)
        return self.current.views[id(module)]

    def _enter(self, unit: Unit) -> None:
        """Make `unit` the one computing: its copy waited for (made now if absent or stale), the next copies begun."""
        ops, timing = self.ops, self.timing
        if timing is not None and (measured := timing.entering(unit)) is not None:
            self.measured, self.timing, timing = measured, None, None
        if self.staging:
            self._release_staging()
        if self.current is not None:
            ops.computed(self.current.free)  # every use of the unit left is queued: its slot may be written after
            self.after[id(self.current.unit)] = unit
        slot = self._holding(unit)
        if slot is None or slot.stamp != unit.stamp():
            slot = self._load(unit, slot)
        if timing is not None:
            timing.waiting(unit)
        ops.compute_after(slot.copied)
        if timing is not None:
            timing.waited(unit)
        self.current = slot
        following = unit
        for _ in range(len(self.slots) - 1):
            following = self.after[id(following)]
            if following is unit:
                break
            held = self._holding(following)
            if held is None or held.stamp != following.stamp():
                self._load(following, held)

    def copy_seconds(self, unit: Unit) -> float:
        """Seconds one copy of `unit` into the ring takes, timed on the host between two synchronisations (for
        placing only); the copy is kept, as a prefetch would have made it."""
        self.ops.synchronize()
        start = time.perf_counter()
        self._load(unit, self._holding(unit))
        self.ops.synchronize()
        return time.perf_counter() - start

    def _release_staging(self, rewriting: _Slot | None = None) -> None:
        """Let go of the file-tier staging whose copies are done (asking, never waiting), so the tier reads ahead
        into it; a slot about to be written again (`rewriting`) hands what it still holds to `retiring`."""
        finished = self.ops.finished
        for slot in self.slots:
            if slot.staged and (slot is rewriting or finished(slot.copied)):
                if not finished(slot.copied):
                    self.retiring.append((slot.copied, slot.staged))
                slot.staged = []
        if self.retiring:
            self.retiring = [(event, held) for event, held in self.retiring if not finished(event)]

    def _holding(self, unit: Unit) -> _Slot | None:
        return next((slot for slot in self.slots if slot.unit is unit), None)

    def _load(self, unit: Unit, slot: _Slot | None) -> _Slot:
        """Copy `unit` into `slot` (its own, stale), or into the ring's next slot other than the computing one."""
        if slot is None:
            slot = self.slots[self.turn]
            if slot is self.current:
                self.turn = (self.turn + 1) % len(self.slots)
                slot = self.slots[self.turn]
            self.turn = (self.turn + 1) % len(self.slots)
        ops = self.ops
        ops.copy_after(slot.free)  # the compute that read the slot's last unit is done
        self._release_staging(slot)
        tensors = unit.tensors()
        stamp, host = unit.stamp(tensors), unit.host_range(tensors)
        if unit.in_file:  # read now, or taken from the tier's read ahead (its checks raise on a changed file)
            tensors = slot.staged = [file_tier.held(owner, name) for (owner, name), *_ in unit.holders]
        offsets, at = [], 0
        for tensor in tensors:
            offsets.append(at if host is None else tensor.data_ptr() - tensors[0].data_ptr())
            at += padded(tensor.nbytes)
        if at > slot.buffer.numel():  # a weight replaced by a larger one since placing (a resized embedding)
            raise EngineError(f"the streamed weights of `{unit.name}` grew to {at} bytes since they were placed, "
                               f"past the {slot.buffer.numel()} of a ring slot: offload the model again")
        if self.timing is not None:
            self.timing.copying(unit)
        if host is not None:
            ops.copy(slot.buffer[: host.numel()], host)
        else:
            for tensor, offset in zip(tensors, offsets, strict=True):
                ops.copy(slot.buffer[offset:offset + tensor.nbytes], _bytes(tensor))
        if self.timing is not None:
            self.timing.copied_unit(unit)
        ops.copied(slot.copied)
        views: dict[int, dict[str, Tensor]] = {id(owner): {} for owner in unit.owners}
        for holders, tensor, offset in zip(unit.holders, tensors, offsets, strict=True):
            view = slot.buffer[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            for owner, name in holders:
                views[id(owner)][name] = view
        slot.unit, slot.stamp, slot.views = unit, stamp, views
        return slot


def fetcher_for(journal: Journal, ops: DeviceOps | None, device: torch.device, host_tier: list[nn.Module],
                units: Sequence[Unit], *, pinned: bool, expansion: int = 0) -> tuple[TorchFetcher, int]:
    """The fetcher a host places a tree with, and the bytes of its host tier pinned: where `ops` stream `units` to
    `device`, a unit streamer over the host tier packed unit by unit (`arena.pack`, `pinned` for asynchronous
    copies), with a reused expansion buffer of `expansion` bytes; else plain torch copies, asynchronous from pinned
    pieces where `pinned`."""
    streams = ops is not None and bool(units)
    in_units = {id(owner) for unit in units for owner in unit.owners}
    groups = [unit.owners for unit in units] + [[owner] for owner in host_tier if id(owner) not in in_units]
    pinned_bytes = arena.pack(journal, groups, pinned=pinned) if pinned or streams else 0
    if streams:
        return UnitStreamer(ops, device, units, expansion=expansion), pinned_bytes
    fetcher = TorchFetcher()
    fetcher.non_blocking = pinned
    return fetcher, pinned_bytes


def _bytes(tensor: Tensor) -> Tensor:
    """A tensor's bytes, flat (a contiguous copy first where it is not contiguous)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)
