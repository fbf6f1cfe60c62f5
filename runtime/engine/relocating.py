"""Relocating containers: direct parameters and buffers that follow the compute device.

A partial load never moves the direct tensors of a container (layer-scale `gamma`) or of a
buffer-only module (rotary `inv_freq`). `relocating_class(cls)` derives a subclass whose
attribute reads of those tensors move them to the tree's compute device first, so reads from
outside the container's own forward (a loop reading `block.gamma`) are covered too.
"""

from __future__ import annotations

from torch import nn

from .classes import picklable

_CLASSES: dict[type, type] = {}


def relocating_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _CLASSES:
        _CLASSES[cls] = _derive(cls)
    return _CLASSES[cls]


def _derive(cls: type[nn.Module]) -> type[nn.Module]:
    original_getattr = cls.__getattr__

    def __getattr__(self, name: str):
        value = original_getattr(self, name)
        if name in self.__dict__.get("_sw_relocated", ()):
            value = self._sw_tree.follow(self, name, value)
        return value

    return type(
        f"Relocating{cls.__name__}",
        (cls,),
        {
            "__getattr__": __getattr__,
            "__module__": __name__,
            "__doc__": f"{cls.__qualname__}, whose direct tensors follow the compute device (Streamwise).",
            "_sw_original_class": cls,
            **picklable(relocating_class, cls),
        },
    )
