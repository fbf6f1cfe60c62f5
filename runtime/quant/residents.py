"""Quantized residents: Linear leaves that hold their weight in a quant format's raw storage.

A resident streams like any streamed leaf (ComfyUI's flags and weight functions), but its
stored tensors always travel in their raw dtype: the host never casts them, and their
`<param>_comfy_model_dtype` pins that dtype where newer ComfyUI cores read it. Weight functions
(LoRA) apply to the dequantized weight, also when the resident is fully loaded: the ComfyUI host
attaches patches as weight functions instead of merging them into raw storage.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..engine.classes import picklable
from ..engine.tree import cast_for_compute
from .formats import FORMATS

_CLASSES: dict[tuple[type, str], type] = {}
_ALIGNMENT = 64
#: Where a host keeps a patch it would have merged into the weight, were the storage float.
MERGED_PATCH = "_sw_merged_patch"


def resident_class(cls: type[nn.Module], fmt: str) -> type[nn.Module]:
    original = getattr(cls, "_sw_original_class", cls)
    key = (original, fmt)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{fmt.title().replace('_', '')}{original.__name__}", (original,), {
            "forward": _forward,
            "__module__": __name__,
            "__doc__": f"{original.__qualname__} holding its weight as `{fmt}` (Streamwise resident).",
            "_sw_original_class": original,
            "_sw_kind": "linear",
            "_sw_format": fmt,
            "_sw_handler": FORMATS[fmt],
            "_sw_fetched": (*FORMATS[fmt].stored, "bias"),
            "compile_safe": FORMATS[fmt].compile_safe,
            **picklable(resident_class, original, fmt),
        })
    return _CLASSES[key]


def make_resident(module: nn.Module, fmt: str, stored: dict[str, Tensor], attributes: dict[str, object]) -> None:
    """Turn a Linear (plain or streamed) into a resident holding `stored` as parameters."""
    for name, tensor in stored.items():
        if tensor.data_ptr() % _ALIGNMENT:  # a view into a file map: packed kernels need aligned storage
            tensor = tensor.clone()
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        module.__dict__[f"{name}_comfy_model_dtype"] = tensor.dtype
    module.__class__ = resident_class(type(module), fmt)
    module.__dict__.update(attributes)
    for name, default in (("comfy_cast_weights", False), ("weight_function", []), ("bias_function", [])):
        module.__dict__.setdefault(name, default)


def _weight_functions(module: nn.Module) -> list:
    """The functions to apply to the dequantized weight: a patch the host merged (raw storage cannot
    take one) while the host counts the weight as patched, then the weight functions."""
    merged = module.__dict__.get(MERGED_PATCH)
    if merged is not None and module.__dict__.get("comfy_patched_weights", False):
        return [merged, *module.weight_function]
    return module.weight_function


def _stored(module: nn.Module, x: Tensor, patched: bool) -> tuple[dict[str, Tensor], Tensor | None]:
    names = module._sw_fetched
    if module.comfy_cast_weights or patched:
        tree = module._sw_tree
        tree.compute_device = x.device
        tensors = tree.fetcher.fetch_raw(module, names, x.device)
    else:
        tensors = [getattr(module, name) for name in names]
    return dict(zip(names[:-1], tensors)), tensors[-1]


def _forward(self, input: Tensor) -> Tensor:  # named as nn.Linear's, for callers that pass it by keyword
    fmt = self._sw_handler
    functions = _weight_functions(self)
    patched = bool(functions or self.bias_function)
    stored, bias = _stored(self, input, patched)
    if not patched:
        return fmt.linear(self, input, stored, bias)
    weight = fmt.dequantize(self, stored, input.dtype)
    if functions and fmt.dequantizes_to_a_view(self, input.dtype):
        weight = weight.clone()  # a stored float read as it is: a weight function may write into it
    for function in functions:
        weight = function(weight)
    return F.linear(input, weight, cast_for_compute(bias, input.device, input.dtype, self.bias_function))
