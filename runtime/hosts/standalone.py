"""`offload(model, policy, device=..., budget=...)`: low-VRAM inference without ComfyUI.

Streamed leaves keep their weights on the offload device (pinned CPU memory when CUDA is
present). As many leaves as fit the budget, in forward order, become resident on the compute
device and run the original forward; the others fetch their weights per forward. On CUDA the
next streamed leaf's weights are copied on a side stream while the current one computes. With
offload and compute device both CPU everything still runs, through the same code paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ...schemas import Policy
from ..apply import apply, applied_state
from ..diagnostics import PolicyError
from ..loading import load_policy
from ..resolve import resolve


@dataclass(frozen=True)
class OffloadReport:
    device: str
    offload_device: str
    resident_modules: int
    streamed_modules: int
    resident_bytes: int
    streamed_bytes: int


def offload(
    model: nn.Module,
    policy: Policy | str | Path,
    *,
    device: str | torch.device,
    budget: int | None = None,
    offload_device: str | torch.device = "cpu",
    prefetch: bool = True,
) -> OffloadReport:
    """Convert `model` by `policy` and stream it from `offload_device` to `device` within `budget` bytes.

    `budget=None` makes every streamed leaf resident. Tensors outside the plan are moved to the
    compute device; relocated ones follow it on their own. `prefetch` (CUDA only) overlaps the
    next leaf's copy with the current leaf's compute.
    """
    device, offload_device = torch.device(device), torch.device(offload_device)
    policy = policy if isinstance(policy, Policy) else load_policy(policy)
    plan = resolve(policy, model)
    if not plan.ok:
        raise PolicyError(plan.diagnostics)
    apply(plan, model)
    state = applied_state(model)
    leaves = [model.get_submodule(entry.path) for entry in plan.modules if entry.stream]
    streamer = _Streamer(device, pin=device.type == "cuda" and offload_device.type == "cpu", prefetch=prefetch)
    resident_bytes = streamed_bytes = resident_count = 0
    for leaf in leaves:
        size = _leaf_bytes(leaf)
        resident = budget is None or resident_bytes + size <= budget
        _place(leaf, device if resident else offload_device, pin=streamer.pin and not resident)
        leaf.comfy_cast_weights = not resident
        if resident:
            resident_bytes, resident_count = resident_bytes + size, resident_count + 1
        else:
            streamed_bytes += size
    converted = {id(leaf) for leaf in leaves} | {id(m) for m in state.tree.relocating}
    for module in model.modules():
        if id(module) not in converted:
            _place(module, device, pin=False)
    state.tree.compute_device = device
    state.tree.fetcher = streamer
    if policy.compile.enabled:
        from ..compile import lazy_compile

        lazy_compile(model, policy)
    return OffloadReport(str(device), str(offload_device), resident_count, len(leaves) - resident_count, resident_bytes, streamed_bytes)


def _leaf_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))


def _place(module: nn.Module, device: torch.device, *, pin: bool) -> None:
    """Move a module's direct parameters and buffers, keeping every Parameter object."""
    for name, parameter in module.named_parameters(recurse=False):
        if parameter.device != device or (pin and not parameter.is_pinned()):
            data = parameter.data.to(device)
            parameter.data = data.pin_memory() if pin else data
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.device != device:
            module._buffers[name] = buffer.to(device)


class _Streamer:
    """Fetches streamed weights; on CUDA, prefetches the next leaf's weights on a side stream."""

    def __init__(self, device: torch.device, *, pin: bool, prefetch: bool) -> None:
        self.device = device
        self.pin = pin
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda and prefetch else None
        self.order: list[nn.Module] = []
        self.position: dict[int, int] = {}
        self.ready: dict[int, tuple[Tensor | None, Tensor | None, object]] = {}

    def fetch(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None):
        if self.side is not None:  # prefetching: learn the forward order, take what was copied ahead
            key = id(module)
            if key not in self.position:
                self.position[key] = len(self.order)
                self.order.append(module)
            weight, bias = self._take(module)
            self._prefetch_after(key)
        else:  # plain tensor ops: also what torch.compile traces cleanly inside a block
            weight, bias = _copy(module, device)
        weight = _finish(weight, dtype, module.weight_function)
        bias = _finish(bias, dtype, module.bias_function)
        return weight, bias, None

    def release(self, module, weight, bias, handle) -> None:
        pass

    def fetch_raw(self, module: nn.Module, names: tuple[str, ...], device: torch.device):
        return [None if (t := getattr(module, name)) is None else t.to(device, non_blocking=True) for name in names]

    def stop_prefetching(self) -> None:
        """Copy on demand from now on (compiled blocks cannot trace the side-stream bookkeeping)."""
        self.side = None
        self.ready.clear()

    def _take(self, module: nn.Module) -> tuple[Tensor | None, Tensor | None]:
        ready = self.ready.pop(id(module), None)
        if ready is None:
            return _copy(module, self.device)
        weight, bias, event = ready
        torch.cuda.current_stream(self.device).wait_event(event)
        for tensor in (weight, bias):
            if tensor is not None:
                tensor.record_stream(torch.cuda.current_stream(self.device))
        return weight, bias

    def _prefetch_after(self, key: int) -> None:
        following = self.position[key] + 1
        if following >= len(self.order):
            following = 0  # the next forward starts over
        module = self.order[following]
        if id(module) in self.ready or not module.comfy_cast_weights:
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            weight, bias = _copy(module, self.device)
            event = torch.cuda.Event()
            event.record(self.side)
        self.ready[id(module)] = (weight, bias, event)


def _copy(module: nn.Module, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    bias = getattr(module, "bias", None)
    return (
        module.weight.to(device, non_blocking=True),
        None if bias is None else bias.to(device, non_blocking=True),
    )


def _finish(tensor: Tensor | None, dtype: torch.dtype | None, functions) -> Tensor | None:
    """Cast on the compute device, then apply weight functions to a private copy."""
    if tensor is None:
        return None
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    elif functions:
        tensor = tensor.clone()
    for function in functions:
        tensor = function(tensor)
    return tensor
