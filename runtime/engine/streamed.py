"""Streamed leaves: the original class, plus ComfyUI's low-VRAM protocol.

`streaming_class(cls, kind)` derives a subclass that carries `comfy_cast_weights`,
`weight_function` and `bias_function`. While none of those is set (the weights are resident), its
forward is the original forward: no copies, one flag check. Otherwise the tree's fetcher brings
the weights to the activation's device and the compute kind computes with them.
"""

from __future__ import annotations

import inspect

from torch import Tensor, nn

from .classes import picklable
from .kinds import COMPUTE_KINDS, ComputeKind

_CLASSES: dict[tuple[type, str], type] = {}


def streaming_class(cls: type[nn.Module], kind: str) -> type[nn.Module]:
    """The streamed counterpart of `cls` computing as `kind` (one class per pair, cached)."""
    key = (cls, kind)
    if key not in _CLASSES:
        _CLASSES[key] = _derive(cls, COMPUTE_KINDS[kind])
    return _CLASSES[key]


def _derive(cls: type[nn.Module], kind: ComputeKind) -> type[nn.Module]:
    original_forward = cls.forward
    input_name = _input_name(original_forward)

    def forward(self, *args, **kwargs):
        if self.comfy_cast_weights or self.weight_function or self.bias_function:
            return _streamed_forward(self, kind, input_name, args, kwargs)
        return original_forward(self, *args, **kwargs)

    return type(
        f"Streamed{cls.__name__}",
        (cls,),
        {
            "forward": forward,
            "__module__": __name__,
            "__doc__": f"{cls.__qualname__}, streamed by Streamwise (compute kind `{kind.name}`).",
            "_sw_original_class": cls,
            "_sw_kind": kind.name,
            **picklable(streaming_class, cls, kind.name),
        },
    )


def _input_name(forward) -> str | None:
    """The name of the input parameter of `forward` (its first after self), for calls by keyword."""
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    first = parameters[0] if parameters else None
    return first.name if first is not None and first.kind is not first.VAR_POSITIONAL else None


def _streamed_forward(module: nn.Module, kind: ComputeKind, input_name: str | None, args: tuple, kwargs: dict) -> Tensor:
    if args:
        x, args = args[0], args[1:]
    else:  # called with the input by keyword (`layer(input=x)`)
        x = kwargs.pop(input_name if input_name in kwargs else next(iter(kwargs)))
    tree = module._sw_tree
    tree.compute_device = x.device
    dtype = x.dtype if kind.dtype == "input" else None
    weight, bias, handle = tree.fetcher.fetch(module, x.device, dtype)
    try:
        return kind.compute(module, x, weight, bias, *args, **kwargs)
    finally:
        tree.fetcher.release(module, weight, bias, handle)
