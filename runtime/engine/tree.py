"""Per-tree streaming state: where the tree computes, and how its streamed weights are fetched.

Every converted module of one model tree points at the same `StreamTree`. Nothing here is
process-global, so two trees on two devices in one process never disturb each other. The
compute device is set by the host when it loads the tree and refreshed by every streamed forward
from its activations, the one signal that never lies under partial offload.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn


class Fetcher(Protocol):
    """Brings a streamed leaf's weight and bias to the compute device for one forward."""

    def fetch(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> tuple[Tensor | None, Tensor | None, object]:
        ...

    def release(self, module: nn.Module, weight: Tensor | None, bias: Tensor | None, handle: object) -> None:
        ...

    def fetch_raw(self, module: nn.Module, names: tuple[str, ...], device: torch.device) -> list[Tensor | None]:
        """Tensors of a quantized resident, moved as they are stored: never cast, no functions applied."""
        ...


class TorchFetcher:
    """Plain torch: copy to the device (and dtype), then apply the module's weight functions."""

    non_blocking = False
    """Let host-to-device copies return early: only for a host that pins the offloaded weights."""

    def fetch_raw(self, module, names, device):
        return [None if (t := getattr(module, name)) is None else t.to(device, non_blocking=self.non_blocking) for name in names]

    def fetch(self, module, device, dtype):
        return self.for_compute(module, module.weight, getattr(module, "bias", None), device, dtype)

    def for_compute(self, module: nn.Module, weight: Tensor | None, bias: Tensor | None, device: torch.device, dtype: torch.dtype | None):
        """`fetch`'s result from the leaf's weight and bias, wherever they were copied to so far."""
        return (
            cast_for_compute(weight, device, dtype, module.weight_function, self.non_blocking),
            cast_for_compute(bias, device, dtype, module.bias_function, self.non_blocking),
            None,
        )

    def release(self, module, weight, bias, handle) -> None:
        pass


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
    def __init__(self) -> None:
        self.compute_device: torch.device | None = None
        self.fetcher: Fetcher = TorchFetcher()
        self.relocating: list[nn.Module] = []

    def follow(self, module: nn.Module, name: str, value: Tensor | None) -> Tensor | None:
        """Move a relocated tensor of `module` to the compute device, in place, and return it."""
        device = self.compute_device
        if value is None or device is None or value.device == device:
            return value
        return _move(module, name, device)

    def offload_relocated(self, device: torch.device) -> None:
        """Send every relocated tensor back to `device` (on unload), so VRAM does not creep."""
        for module in self.relocating:
            for name in module._sw_relocated:
                value = module._parameters.get(name, module._buffers.get(name))
                if value is not None and value.device != device and not value.is_meta:  # meta holds no data to move
                    _move(module, name, device)


def _move(module: nn.Module, name: str, device: torch.device) -> Tensor:
    if name in module._parameters:
        parameter = module._parameters[name]
        moved = parameter.data.to(device)
        try:
            parameter.data = moved  # the Parameter object (and every alias of it) stays the same
        except RuntimeError:  # some device pairs (to meta, say) cannot swap storage under a tensor
            torch.utils.swap_tensors(parameter, nn.Parameter(moved, requires_grad=parameter.requires_grad))
        return parameter
    moved = module._buffers[name].to(device)
    module._buffers[name] = moved
    return moved
