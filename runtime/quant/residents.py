"""Quantized residents: Linear leaves that hold their weight in a quant format's raw storage.

A resident is a streamed leaf (`engine.streamed`) whose leaf kind computes through its format handler:
- its stored tensors always travel in their raw dtype: fetched raw, never cast, and pinned to that dtype where
  newer ComfyUI cores read it;
- weight functions (LoRA) apply to the dequantized weight, also when the resident is fully loaded (the ComfyUI
  host keeps a patch it would have merged beside them, see `engine.protocol.weight_functions`);
- model code reading `module.weight` sees the float weight it stands for (`quantized_weight`): the compute dtype
  (`protocol.COMPUTE_DTYPE`, following casts of the model) and the logical shape; the storage stays the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..engine import protocol
from ..engine.classes import derived_class
from ..engine.journal import Journal
from ..engine.kinds import ComputeKind
from ..engine.stand_in import WriteRefused, applied_dtype
from ..engine.streamed import leaf_namespace
from ..engine.tree import StreamTree, cast_for_compute
from .formats import FORMATS, QuantFormat
from .quantized_weight import QuantizedWeight

_ALIGNMENT = 64


class ResidentKind:
    """The leaf kind of a resident: fetch the raw storage as it is, compute with the format handler."""

    name = "linear"  # what it computes, so counts and selectors see a Linear

    def __init__(self, handler: QuantFormat) -> None:
        self.handler = handler
        self.names = (*handler.stored, "bias")

    def resident_forward(self, cls: type[nn.Module]):
        def forward(module: nn.Module, input: Tensor) -> Tensor:  # named as nn.Linear's, for calls by keyword
            return self.compute(module, input, [module._parameters.get(name) for name in self.names])

        return forward

    split = ComputeKind.split  # the input comes first, as nn.Linear's does

    def fetch(self, fetcher, module: nn.Module, x: Tensor) -> list[Tensor | None]:
        return fetcher.fetch_raw(module, self.names, x.device)

    def compute(self, module: nn.Module, x: Tensor, fetched: list[Tensor | None]) -> Tensor:
        *tensors, bias = fetched
        stored = dict(zip(self.handler.stored, tensors, strict=True))
        functions, bias_functions = protocol.weight_functions(module), protocol.bias_functions(module)
        if not functions and not bias_functions:
            return self.handler.linear(module, x, stored, bias)
        weight = self.handler.dequantize(module, stored, x.dtype)
        if functions and self.handler.dequantizes_to_a_view(module, x.dtype):
            weight = weight.clone()  # a stored float read as it is: a weight function may write into it
        for function in functions:
            weight = function(weight)
        return F.linear(x, weight, cast_for_compute(bias, x.device, x.dtype, bias_functions))

    def release(self, fetcher, module: nn.Module, fetched: list[Tensor | None]) -> None:
        pass


def expansion_bytes(modules: Iterable[nn.Module]) -> int:
    """Memory a forward on the CPU needs beside the weights to expand the largest of these Linear layers' quantized
    weights at a call: its float32 values, and as much again for the expansion's intermediates and the cast to the
    compute dtype. Known at load time, so a host budget counts it (the dequant cache comes out of what is left)."""
    return 2 * max((m.in_features * m.out_features * 4 for m in modules if isinstance(m, nn.Linear)), default=0)


def device_expansion_bytes(modules: Iterable[nn.Module], device: torch.device) -> int:
    """The bytes of the largest weight these residents expand at a call on `device` (`QuantFormat.linear`), in
    their compute dtype: what a tree's reused expansion buffer there holds (`Fetcher.expansion`)."""
    return max((m.out_features * m.in_features * m.__dict__[protocol.COMPUTE_DTYPE].itemsize for m in modules
                if (handler := protocol.quant_handler(m)) is not None and handler.expands_at_call
                and not handler.computes_directly(m.__dict__, device)), default=0)


def resident_class(cls: type[nn.Module], format_name: str) -> type[nn.Module]:
    original = protocol.original_class(cls)
    handler = FORMATS[format_name]

    def namespace() -> dict[str, object]:
        leaf = leaf_namespace(original, ResidentKind(handler))
        leaf_apply = leaf["_apply"]

        def _apply(module: nn.Module, fn, *args, **kwargs):
            applied = leaf_apply(module, fn, *args, **kwargs)  # the storage: moved, never cast (it is no float)
            module.__dict__[protocol.COMPUTE_DTYPE] = applied_dtype(fn, module.__dict__[protocol.COMPUTE_DTYPE])
            return applied

        def __setattr__(module: nn.Module, name: str, value: object) -> None:
            if name in handler.stored and isinstance(value, Tensor):
                return _kept_out(module, name, value)
            return original.__setattr__(module, name, value)

        return {
            **leaf,
            "_apply": _apply,
            "__setattr__": __setattr__,
            "weight": property(QuantizedWeight.of, doc="The float weight the storage stands for (`QuantizedWeight`)."),
            "__doc__": f"{original.__qualname__} holding its weight as `{format_name}` (Streamwise resident).",
            protocol.HANDLER: handler,
        }

    name = f"{format_name.title().replace('_', '')}{original.__name__}"
    return derived_class(resident_class, (original, format_name), name, original, namespace)


def _kept_out(module: nn.Module, name: str, value: Tensor) -> None:
    """Refuse a tensor assigned over a resident's storage (`m.weight = nn.Parameter(t)`, `load_state_dict(...,
    assign=True)`, and transformers' `tie_weights()` on a head a rule quantized): the storage would become values its
    format's kernel cannot read, and the next forward would fail inside it."""
    shown = QuantizedWeight.of(module)
    raise WriteRefused(f"assigning `{name}` a {tuple(value.shape)} {value.dtype} tensor over {shown.describe()}: its "
                       f"storage would become values its `{shown.format_name}` kernel cannot read; {shown.remedy()}")


def make_resident(
    module: nn.Module,
    format_name: str,
    stored: dict[str, Tensor],
    attributes: dict[str, object],
    journal: Journal | None = None,
    tree: StreamTree | None = None,
) -> None:
    """Turn a Linear (plain or streamed) into a resident holding `stored` as parameters: all of it or, on any
    failure, none (with a caller's `journal`, what the caller journaled is undone too, as `apply` does)."""
    journal = journal or Journal()
    replaced = module._parameters.get("weight")
    with journal.atomic(lambda exc: None):
        aligned = {}
        for name, tensor in stored.items():
            aligned[name] = tensor.clone() if tensor.data_ptr() % _ALIGNMENT else tensor  # packed kernels need it
            journal.set_tensor(module, name, nn.Parameter(aligned[name], requires_grad=False))
        leaf = {k: v for k, v in protocol.leaf_attributes(module, tree).items() if k not in module.__dict__}
        if tree is None:
            leaf.pop(protocol.TREE, None)
        compute_dtype = _compute_dtype(module, replaced)
        _compute_dtype_first(module, compute_dtype, journal)
        attributes = {**leaf, **protocol.stored_dtype_attributes(aligned),
                      protocol.COMPUTE_DTYPE: compute_dtype, **attributes}
        journal.swap_class(module, resident_class(type(module), format_name), attributes, "resident",
                           clears=tuple(protocol.LEAF_DEFAULTS))


def _compute_dtype_first(module: nn.Module, compute_dtype: torch.dtype, journal: Journal) -> None:
    """Order the resident's parameters so a float one of its compute dtype (its bias) comes first, then other floats
    (scales), then the raw storage: model code that takes `next(module.parameters()).dtype` for the dtype to cast its
    input to (diffusers' Wan and Stable Audio time embedders, many pipelines) gets the compute dtype, not the
    storage's integers. A resident with no float parameter of its own still answers its storage dtype there."""
    parameters = module._parameters
    order = list(parameters)

    def rank(name: str) -> int:
        tensor = parameters[name]
        if tensor is None or not tensor.is_floating_point():
            return 2
        return 0 if tensor.dtype == compute_dtype else 1

    wanted = sorted(order, key=rank)
    if wanted != order:
        _reorder(parameters, wanted)
        journal.add(lambda: _reorder(parameters, [name for name in order if name in parameters]))


def _reorder(parameters: dict, names: list[str]) -> None:
    """`parameters` (a module's own dict, kept in place) in the order `names` gives."""
    items = [(name, parameters.pop(name)) for name in names]
    parameters.update(items)


def _compute_dtype(module: nn.Module, replaced: Tensor | None) -> torch.dtype:
    """The dtype model code sees a resident's weight in: that of the float weight it replaces (a skeleton's, for a
    load), or, made anew from a resident, the one it had."""
    if replaced is not None and replaced.is_floating_point():
        return replaced.dtype
    return module.__dict__.get(protocol.COMPUTE_DTYPE, torch.float32)
