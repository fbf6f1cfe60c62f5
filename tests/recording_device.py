"""A recording fake of the streamer's device seam (`engine.stream.device.DeviceOps`), on the CPU.

Copies are done at once (the CPU is the 'device'), and every call is logged in order, beside whatever the test logs
into the same list (a forward hook's compute), so a test reads the schedule the streamer issued: which copy came
before which compute, which event each stream waited for, and what was made when.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch import Tensor


class Event:
    numbers = itertools.count()

    def __init__(self) -> None:
        self.number = next(self.numbers)
        self.time: float | None = None  # a timer's: when it was last recorded (the CPU's clock: copies run at once)

    def __repr__(self) -> str:
        return f"Event({self.number})"


class RecordingOps:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.buffers: list[Tensor] = []

    def buffer(self, nbytes: int) -> Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(buffer)
        self.log.append(("buffer", nbytes))
        return buffer

    def event(self) -> Event:
        event = Event()
        self.log.append(("event", event))
        return event

    def timer(self) -> Event:
        timer = Event()
        self.log.append(("timer", timer))
        return timer

    def seconds(self, start: Event, end: Event) -> float:
        self.log.append(("seconds", start, end))
        return end.time - start.time

    def copy(self, destination: Tensor, source: Tensor) -> None:
        destination.copy_(source)
        self.log.append(("copy", self.slot_of(destination), source.data_ptr(), source.nbytes))

    def copied(self, event: Event) -> None:
        event.time = time.perf_counter()
        self.log.append(("copied", event))

    def computed(self, event: Event) -> None:
        event.time = time.perf_counter()
        self.log.append(("computed", event))

    def copy_after(self, event: Event) -> None:
        self.log.append(("copy_after", event))

    def compute_after(self, event: Event) -> None:
        self.log.append(("compute_after", event))

    def finished(self, event: Event) -> bool:
        return True  # every copy is done at once

    def synchronize(self) -> None:
        self.log.append(("synchronize",))

    def slot_of(self, tensor: Tensor) -> int:
        """The index of the buffer `tensor` lies in."""
        address = tensor.data_ptr()
        return next(i for i, b in enumerate(self.buffers) if b.data_ptr() <= address < b.data_ptr() + b.nbytes)
