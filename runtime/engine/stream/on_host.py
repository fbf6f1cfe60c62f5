"""Computing a streamed block on the host, where its weights lie: activations cross the link instead of weights.

A decode step multiplies each weight by a row or two: streaming a block costs W / B_link, while the host computes the
same block in the time its CPU takes to read W once (quantized weights through the CPU kernels that read their stored
blocks, `quant.cpu_matmul`). A prompt multiplies them by hundreds of rows, and the device's compute behind a streamed
copy wins. So the choice is made per block and per input size (rows: the input's elements over its last dimension,
counted by the power of two at or above them) from two costs per byte (`StreamCosts`): the link's, timed by one copy
of the largest unit when placing, and the host's at that size, timed the first time a block meets it (that block
synchronises the device once; the log names it). A block computes on the host where that costs less than its copy;
the first step after a change of size may still prefetch a block the ring learned to expect, once.

Computing on the host, the block's tensor arguments go to the host and its outputs come back; its streamed leaves read
their host tensors (`UnitStreamer.on_host`). What a block keeps across calls, a KV cache, lies where the block last
computed it: inside the block, an operation mixing devices (appending this step's keys to the cache) runs where the
block computes, an in-place one where its target lies (`_OneDevice`). A block qualifies when every parameter of it is
in its unit and it holds no buffers, so nothing else of it lives on the device; a compiled model does not compute on
the host (its graphs are traced for the device).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from ...sizes import human
from .. import protocol
from ..journal import Journal
from .streamer import Unit, UnitStreamer

_log = logging.getLogger("streamwise.offload")
HOST = torch.device("cpu")


@dataclass
class StreamCosts:
    """Seconds per byte of a unit: one copy to the device (`link`), and its computation on the host (`host`, by input
    rows rounded up to a power of two). What is left out is measured; figures given (a test's, or a user's from an
    earlier run) are used as they are."""

    link: float | None = None
    host: dict[int, float] = field(default_factory=dict)


def install(journal: Journal, streamer: UnitStreamer, costs: StreamCosts) -> int:
    """Let the block of each qualifying unit compute on the host where that is cheaper than its copy; returns how
    many blocks may (the link timed now, where `costs` lacks it)."""
    units = [unit for unit in streamer.units if _qualifies(unit)]
    if units and costs.link is None:
        largest = max(units, key=lambda unit: unit.nbytes)
        costs.link = streamer.copy_seconds(largest) / largest.nbytes
        _log.info("offload: the link copies %s in %.2f ms (timed when placing)", human(largest.nbytes),
                  costs.link * largest.nbytes * 1e3)
    for unit in units:
        journal.keep(unit.block, ("forward",))
        unit.block.forward = OnHost(streamer, costs, unit, unit.block.__dict__.get("forward"))
    return len(units)


def uninstall(journal: Journal, model: nn.Module) -> None:
    """Take back every block forward an earlier placing installed: the blocks run their own forward again."""
    for module in model.modules():
        own = module.__dict__.get("forward")
        if isinstance(own, OnHost):
            journal.keep(module, ("forward",))
            if own.replaced is None:
                del module.forward
            else:
                module.forward = own.replaced


class OnHost:
    """A block's forward choosing, per call, between its own forward on the device and the same on the host."""

    def __init__(self, streamer: UnitStreamer, costs: StreamCosts, unit: Unit, replaced: object) -> None:
        self.streamer, self.costs, self.unit, self.replaced = streamer, costs, unit, replaced
        self.forward = replaced if replaced is not None else type(unit.block).forward.__get__(unit.block)

    def __call__(self, *args, **kwargs):
        streamer, leaf = self.streamer, self.unit.leaves[0]
        tree = protocol.tree_of(leaf)
        if tree is None or tree.fetcher is not streamer or torch.compiler.is_compiling():  # placed otherwise since
            return self.forward(*args, **kwargs)
        rows = _rows(args, kwargs)
        bucket = 1 << max(0, rows - 1).bit_length()
        per_byte = self.costs.host.get(bucket)
        if per_byte is not None and per_byte >= self.costs.link:
            with _OneDevice(streamer.device):
                return self.forward(*args, **kwargs)
        if per_byte is None:  # the first block of this size: timed on the host, the device idle meanwhile
            streamer.ops.synchronize()
            start = time.perf_counter()
        streamer.on_host = self.unit
        try:
            args, kwargs = tree_map_only(Tensor, _to_host, (args, kwargs))
            with _OneDevice(HOST):
                out = self.forward(*args, **kwargs)
            out = tree_map_only(Tensor, lambda t: t.to(streamer.device), out)
        finally:
            streamer.on_host = None
            tree.compute_device = streamer.device  # the leaves saw host activations; relocated tensors stay put
        if per_byte is None:
            per_byte = self.costs.host[bucket] = (time.perf_counter() - start) / self.unit.nbytes
            _log.info("offload: %d rows computed on the host in %.2f ms per %s (`%s`, measured), its copy %.2f ms: "
                      "inputs of up to %d rows %s", rows, per_byte * 2**20 * 1e3, human(2**20), self.unit.name,
                      self.costs.link * 2**20 * 1e3, bucket,
                      "compute on the host" if per_byte < self.costs.link else "stream")
        return out


def _to_host(tensor: Tensor) -> Tensor:
    return tensor.to(HOST)


def _qualifies(unit: Unit) -> bool:
    block = unit.block
    if block is None or next(block.buffers(), None) is not None:
        return False
    held = {id(tensor) for tensor in unit.tensors()}
    return all(id(parameter) in held for parameter in block.parameters())


def _rows(args: tuple, kwargs: dict) -> int:
    """The rows of a block's input (its first tensor argument): elements over the last dimension."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.numel() // max(1, value.shape[-1]) if value.dim() else 1
    return 1


class _OneDevice(TorchFunctionMode):
    """Inside a block computing on `device`: an operation whose tensors lie on several devices runs on `device`, an
    in-place one (or one writing `out=`) where its target lies, its other tensors moved there."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in _tensors(args)} | {t.device for t in _tensors(kwargs.values())}
        if len(devices) > 1:
            target = self.device
            if "out" in kwargs or _in_place(func):
                written = kwargs["out"] if "out" in kwargs else args[0]
                target = (written[0] if isinstance(written, (tuple, list)) else written).device
            args, kwargs = tree_map_only(Tensor, lambda t: t.to(target), (args, kwargs))
        return func(*args, **kwargs)


def _tensors(values) -> list[Tensor]:
    """The tensors among `values` and in the lists among them (`torch.cat`'s)."""
    found = []
    for value in values:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [item for item in value if isinstance(item, Tensor)]
    return found


def _in_place(func) -> bool:
    """Whether `func` writes its first argument: `add_`, `index_copy_`, `__iadd__`, `__setitem__`."""
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name == "__setitem__" or name.startswith("__i") and name not in ("__index__", "__int__", "__invert__")
    return name.endswith("_") and not name.startswith("_")
