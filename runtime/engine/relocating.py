"""Relocating containers: direct parameters and buffers that follow the compute device.

A partial load never moves the direct tensors of a container (layer-scale `gamma`) or of a buffer-only module
(rotary `inv_freq`). `relocating_class(cls)` derives a subclass whose attribute reads of those tensors move them,
in place, to the tree's compute device first, so reads from outside the container's own forward (a loop reading
`block.gamma`) are covered too. Hosts send them back on unload (`offload_relocated`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import file_tier, protocol
from .classes import derived_class
from .tree import move_in_place


def relocating_class(cls: type[nn.Module]) -> type[nn.Module]:
    return derived_class(relocating_class, (cls,), f"Relocating{cls.__name__}", cls, lambda: _namespace(cls))


def _namespace(cls: type[nn.Module]) -> dict[str, object]:
    original_getattr = cls.__getattr__

    def __getattr__(self, name: str):
        value = original_getattr(self, name)
        if name in protocol.relocated_names(self):
            device = protocol.tree_of(self).compute_device
            if value is not None and device is not None and value.device != device:
                value = move_in_place(self, name, device)
        return value

    return {
        "__getattr__": __getattr__,
        "__doc__": f"{cls.__qualname__}, whose direct tensors follow the compute device (Streamwise).",
    }


def offload_relocated(model: nn.Module, device: torch.device) -> None:
    """Send every relocated tensor of `model` back to `device` (on unload), so VRAM does not creep."""
    for module in model.modules():
        for name in protocol.relocated_names(module):
            value = module._parameters.get(name, module._buffers.get(name))
            if value is not None and value.device != device and file_tier.in_memory(value):  # nothing to move
                move_in_place(module, name, device)
