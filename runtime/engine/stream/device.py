"""The device operations the streamer issues, behind one small seam.

Everything the streamer asks of a device is here: a buffer, events and timers made when a tree is placed (never per
forward), an asynchronous copy on the copy stream, events recorded on either stream, either stream waiting for one,
and the device time between two timers (`measure`). Nothing synchronises the host, but for measuring a cost
(`synchronize`: placing, and a block's first computation on the host, `on_host`). `CudaOps` implements it with
torch's CUDA calls; a test implements it with CPU tensors and a log of every call (`tests/recording_device.py`),
which is how the schedule is checked on a CPU."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class DeviceOps(Protocol):
    def buffer(self, nbytes: int) -> Tensor:
        """A device buffer of `nbytes` bytes (uint8): a slot of the ring, made when placing."""
        ...

    def event(self) -> object:
        """An event, made when placing and recorded again at every use."""
        ...

    def timer(self) -> object:
        """An event that keeps the device's time when it completes (`seconds`), made when placing."""
        ...

    def seconds(self, start: object, end: object) -> float:
        """Seconds of device time from `start` to `end`, both recorded and done (`finished`): never waits."""
        ...

    def copy(self, destination: Tensor, source: Tensor) -> None:
        """Copy `source` (host, pinned where the device can copy from it asynchronously) into `destination` on the
        copy stream; returns at once."""
        ...

    def copied(self, event: object) -> None:
        """Record `event` on the copy stream: the copies issued so far are done when it completes."""
        ...

    def computed(self, event: object) -> None:
        """Record `event` on the compute stream: the compute issued so far is done when it completes."""
        ...

    def copy_after(self, event: object) -> None:
        """Make the copy stream wait for `event` before the copies issued next."""
        ...

    def compute_after(self, event: object) -> None:
        """Make the compute stream wait for `event` before the compute issued next."""
        ...

    def finished(self, event: object) -> bool:
        """Whether the work before `event`'s last record is done (a query: it never waits)."""
        ...

    def synchronize(self) -> None:
        """Wait on the host for everything issued on both streams: only to time a copy or a computation."""
        ...


class CudaOps:
    """`DeviceOps` of a CUDA device: one copy stream of the streamer's own, the compute stream being the current."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def buffer(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def event(self) -> object:
        return torch.cuda.Event()

    def timer(self) -> object:
        return torch.cuda.Event(enable_timing=True)

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def copy(self, destination: Tensor, source: Tensor) -> None:
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)

    def copied(self, event) -> None:
        event.record(self.stream)

    def computed(self, event) -> None:
        event.record(torch.cuda.current_stream(self.device))

    def copy_after(self, event) -> None:
        self.stream.wait_event(event)

    def compute_after(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def finished(self, event) -> bool:
        return event.query()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def device_ops(device: torch.device) -> DeviceOps | None:
    """The operations streaming to `device` copies with: CUDA's; None where a plain copy serves (the CPU)."""
    return CudaOps(device) if device.type == "cuda" else None
