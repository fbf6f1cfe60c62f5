"""The first streamed forward after placing, timed on the device against its floor.

A streamed forward can be no faster than max(T_compute, W / B_h2d): its compute, or its copies, whichever is longer
(`docs/engine.md`). The ring hides each copy behind the compute before it; where it cannot, the compute stream
waits. So the first forward after placing records timers around each unit's copy (on the copy stream) and around the
compute stream's wait for it, and from the unit after it: its compute, its copies and its waits, each from the device's
own clock. The timers are made when placing; once the forward has wrapped around (a unit entered again) nothing more
is recorded, and the figures are read at the first unit entered after every timer is done (asked, never waited for),
then logged (`streamwise.offload`) and kept (`UnitStreamer.measured`): the forward against its floor, each named.

Placing by measured costs (`offload(..., measure=...)`) times each unit's compute instead, in a measuring forward that
streams every unit with no prefetch and synchronises at each unit's entry (`UnitClock`): a unit's compute is then the
host's time from its copy done to the next unit's entry, kernel launches included, which is the window a copy issued
at that entry can hide behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .device import DeviceOps

if TYPE_CHECKING:
    from .streamer import Unit

_log = logging.getLogger("streamwise.offload")

FLOOR_GOAL = 1.15
"""A forward within this multiple of its floor is where the hardware allows: further is logged as a warning."""


@dataclass(frozen=True)
class ForwardTimes:
    """A streamed forward's times on the device, in seconds: from the first unit entered to the last."""

    units: int
    compute: float
    """The compute stream's work between entering the first unit and the last (the last unit's own excluded)."""
    copies: float
    """The copy stream's copies of those units (the first one's included: the ring's fill)."""
    waited: float
    """How long the compute stream waited for those copies."""

    @property
    def floor(self) -> float:
        return max(self.compute, self.copies)

    @property
    def ratio(self) -> float:
        """The forward's time (its compute and its waits) over its floor."""
        return (self.compute + self.waited) / self.floor if self.floor else 1.0

    def __str__(self) -> str:
        bound = "the copies" if self.copies > self.compute else "the compute"
        return (f"the first streamed forward computed {self.compute * 1e3:.2f} ms across {self.units} units, copied "
                f"{self.copies * 1e3:.2f} ms and waited {self.waited * 1e3:.2f} ms for copies: {self.ratio:.2f}x its "
                f"floor max(compute, copies), set by {bound}")


class UnitTiming(Protocol):
    """What the streamer tells a timing of its units as it streams them (`FirstForward`, `UnitClock`)."""

    def entering(self, unit: Unit) -> ForwardTimes | None:
        """`unit` is entered: the figures, where they are read now."""
        ...

    def copying(self, unit: Unit) -> None: ...

    def copied_unit(self, unit: Unit) -> None: ...

    def waiting(self, unit: Unit) -> None: ...

    def waited(self, unit: Unit) -> None: ...


class FirstForward:
    """Timers of each unit (copy started and done, wait started and done), recorded in the first forward only."""

    def __init__(self, ops: DeviceOps, units: tuple[Unit, ...]) -> None:
        self.ops = ops
        self.timers = {id(unit): [ops.timer() for _ in range(4)] for unit in units}
        self.entered: list[Unit] = []
        self.seen: set[int] = set()  # the entered units, by id
        self.copied: set[int] = set()
        self.recording = False
        """Between the first unit entered and the first entered again: the first forward."""

    def entering(self, unit: Unit) -> ForwardTimes | None:
        """Called as `unit` is entered: the figures, once the first forward is over and its timers are done."""
        if not self.recording and not self.entered:
            self.recording = True
        elif self.recording and id(unit) in self.seen:
            self.recording = False  # the forward wrapped around: the next one is not measured
        if self.recording or not self.ops.finished(self.timers[id(self.entered[-1])][3]):
            return None
        return self._read()

    def copying(self, unit: Unit) -> None:
        if self._records_copy(unit):
            self.ops.copied(self.timers[id(unit)][0])

    def copied_unit(self, unit: Unit) -> None:
        if self._records_copy(unit):
            self.ops.copied(self.timers[id(unit)][1])
            self.copied.add(id(unit))

    def waiting(self, unit: Unit) -> None:
        if self.recording:
            self.ops.computed(self.timers[id(unit)][2])

    def waited(self, unit: Unit) -> None:
        if self.recording:
            self.ops.computed(self.timers[id(unit)][3])
            self.entered.append(unit)
            self.seen.add(id(unit))

    def _records_copy(self, unit: Unit) -> bool:
        return self.recording and id(unit) not in self.copied

    def _read(self) -> ForwardTimes:
        seconds, timers = self.ops.seconds, [self.timers[id(unit)] for unit in self.entered]
        compute = sum(seconds(this[3], after[2]) for this, after in zip(timers, timers[1:], strict=False))
        copies = sum(seconds(timer[0], timer[1]) for unit, timer in zip(self.entered, timers, strict=True)
                     if id(unit) in self.copied)  # done: the compute waited for each
        waited = sum(seconds(timer[2], timer[3]) for timer in timers)
        times = ForwardTimes(len(timers), compute, copies, waited)
        (_log.info if times.ratio <= FLOOR_GOAL else _log.warning)("offload: %s", times)
        return times


class UnitClock:
    """A measuring forward's clock (the streamer's `timing` while it runs): the device synchronised as each unit is
    entered and once its copy is done, each unit's compute timed on the host from then to the next unit's entry (or
    `stop`), and its copy from its entry to its copy done; seconds summed by unit name."""

    def __init__(self, ops: DeviceOps, now: Callable[[], float] = time.perf_counter) -> None:
        self.ops, self.now = ops, now
        self.compute: dict[str, float] = {}
        self.copies: dict[str, float] = {}
        self._computing: tuple[str, float] | None = None
        self._entered = 0.0

    def entering(self, unit: Unit) -> None:
        self.stop()
        self._entered = self.now()

    def waited(self, unit: Unit) -> None:
        self.ops.synchronize()
        now = self.now()
        self.copies[unit.name] = self.copies.get(unit.name, 0.0) + now - self._entered
        self._computing = (unit.name, now)

    def stop(self) -> None:
        """End the computing unit's time: at the next unit's entry, and at the end of each forward."""
        if self._computing is not None:
            self.ops.synchronize()
            name, since = self._computing
            self.compute[name] = self.compute.get(name, 0.0) + self.now() - since
            self._computing = None

    def waiting(self, unit: Unit) -> None:
        pass

    def copying(self, unit: Unit) -> None:
        pass

    def copied_unit(self, unit: Unit) -> None:
        pass
