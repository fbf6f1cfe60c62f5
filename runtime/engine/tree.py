"""Per-tree streaming state, and how streamed weights reach the compute device.

Invariants:
- every converted module of one model tree points at the same `StreamTree`; nothing here is process-global, so
  two trees on two devices in one process never disturb each other;
- the compute device is set by the host when it loads the tree and refreshed by every streamed forward from its
  activations, the one signal that never lies under partial offload;
- a fetch never mutates a stored tensor: weight functions (LoRA) get a private copy.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import Tensor, nn

from . import protocol
from .file_reads import FileTier
from .file_tier import held


class Fetcher(Protocol):
    """Brings a streamed leaf's weight and bias to the compute device for one forward (per call: keep it cheap)."""

    def fetch(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> tuple:
        """(weight, bias, handle) on `device`, in `dtype` (None: as stored), with the weight functions applied."""
        ...

    def release(self, module: nn.Module, weight: Tensor | None, bias: Tensor | None, handle: object) -> None:
        ...

    def fetch_raw(self, module: nn.Module, names: tuple[str, ...], device: torch.device) -> list[Tensor | None]:
        """Tensors of a quantized resident, moved as they are stored: never cast, no functions applied."""
        ...

    def fetch_parameters(self, module: nn.Module, names: tuple[str, ...], device: torch.device) -> list[Tensor | None]:
        """Direct parameters a generic module computes with, moved in their stored dtype, with whatever the host
        would have merged into them by their state-dict key (core's LoRA patches)."""
        ...

    def around_block(self, block: nn.Module) -> AbstractContextManager:
        """Around the compiled graph of `block`: the bookkeeping a graph cannot hold, done before and after it."""
        ...

    def expansion(self, nbytes: int, device: torch.device) -> Tensor | None:
        """`nbytes` of the tree's reused expansion buffer on `device`, where it has one that large: a quantized
        weight expanded at a call is written there, then read by the call's matmul on the same stream; None: a fresh
        allocation."""
        ...


class TorchFetcher:
    """Plain torch: copy to the device (and dtype), then apply the module's weight functions."""

    non_blocking = False
    """Let host-to-device copies return early: only for a host that pins the offloaded weights."""

    def fetch_raw(self, module, names, device):
        return [None if (t := held(module, name)) is None else t.to(device, non_blocking=self.non_blocking)
                for name in names]

    def fetch_parameters(self, module, names, device):
        return self.fetch_raw(module, names, device)  # plain torch patches by weight functions alone

    def fetch(self, module, device, dtype):
        return self.for_compute(module, held(module, "weight"), held(module, "bias"), device, dtype)

    def for_compute(self, module: nn.Module, weight: Tensor | None, bias: Tensor | None, device: torch.device,
                    dtype: torch.dtype | None) -> tuple:
        """`fetch`'s result from the leaf's weight and bias, wherever they were copied to so far."""
        return (
            cast_for_compute(weight, device, dtype, protocol.weight_functions(module), self.non_blocking),
            cast_for_compute(bias, device, dtype, protocol.bias_functions(module), self.non_blocking),
            None,
        )

    def release(self, module, weight, bias, handle) -> None:
        pass

    def around_block(self, block):
        return nullcontext()

    def expansion(self, nbytes, device):
        return None


def cast_for_compute(
    tensor: Tensor | None, device: torch.device, dtype: torch.dtype | None, functions, non_blocking: bool = False
) -> Tensor | None:
    """`tensor` on `device` in `dtype` with the weight functions applied, never mutating the stored one."""
    if tensor is None:
        return None
    # A weight function (a LoRA patch) may write into its input: never hand it the stored tensor.
    tensor = tensor.to(device=device, dtype=dtype, copy=bool(functions), non_blocking=non_blocking)
    for function in functions:
        tensor = function(tensor)
    return tensor


class StreamTree:
    """The state one converted tree shares: where it computes, the host's fetcher, and its file-tier reads."""

    def __init__(self) -> None:
        self.compute_device: torch.device | None = None
        self.fetcher: Fetcher = TorchFetcher()
        self.file_tier: FileTier | None = None
        self.host_budget: int | None = None
        """Bytes of host memory the tree may hold (None: no limit); set where it was loaded from files."""


def move_in_place(module: nn.Module, name: str, device: torch.device, *, pin: bool = False) -> Tensor:
    """Move the direct parameter or buffer `name` of `module` to `device`; a Parameter stays the same object
    (and every alias of it, LoRA keys included, stays valid). `pin` pins the moved storage (CPU only)."""
    if name in module._parameters:
        parameter = module._parameters[name]
        moved = parameter.data.to(device)
        moved = moved.pin_memory() if pin else moved
        try:
            parameter.data = moved
        except RuntimeError:  # some device pairs (to meta, say) cannot swap storage under a tensor
            torch.utils.swap_tensors(parameter, nn.Parameter(moved, requires_grad=parameter.requires_grad))
        return parameter
    moved = module._buffers[name].to(device)
    module._buffers[name] = moved.pin_memory() if pin else moved
    return module._buffers[name]
