"""Stand-ins: tensors that show model code a weight's dtype, shape and device while its values live elsewhere.

Model code reads weights directly: `weight.dtype` to cast its activations, `F.linear(x, m.weight)`, `m.weight.T`,
`state_dict()`. A stand-in answers the metadata itself; every other op is the same op on its values, made where the
op's other tensors are (`StandIn.values`); an op that would write into it is refused, naming it (the write would land
in a temporary copy and be lost). Streamed leaves do not read through here: their fetch reads the values once per
forward. Like torchao's quantized tensors and ComfyUI-GGUF's `GGMLTensor`, it is a torch wrapper subclass; a
Parameter of one keeps its class (torch marks it `_is_param`), so `isinstance(t, nn.Parameter)` still holds.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from ...errors import Error

_ALIASING = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
"""Ops that make the same tensor anew (a Parameter's creation, `.data`, `state_dict`): the same stand-in."""


class WriteRefused(Error, RuntimeError):
    """A write into a weight that cannot keep it (a stand-in, a quantized resident's storage)."""


class StandIn(Tensor):
    """A tensor of `shape` and `dtype` on `device` whose values a subclass makes on demand (`values`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # every op reaches `__torch_dispatch__`

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, *,
                requires_grad: bool = False):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def values(self, device: torch.device | None) -> Tensor:
        """Its values as a plain tensor, on `device` (None: where they are made)."""
        raise NotImplementedError

    def alias(self) -> StandIn:
        """The same stand-in as a new tensor object."""
        raise NotImplementedError

    def describe(self) -> str:
        """What it stands in for, for messages."""
        raise NotImplementedError

    def remedy(self) -> str:
        """What to do instead of writing into it, for messages."""
        raise NotImplementedError

    @property
    def data(self) -> StandIn:
        return self.alias()  # as `.data` of any tensor: the same values, a new tensor object

    @data.setter
    def data(self, value: Tensor) -> None:
        raise WriteRefused(f"`.data = ...` replaces the values of {self.describe()}: the new values would be lost; "
                           f"{self.remedy()}")

    def __reduce_ex__(self, protocol: int):
        return self.values(None).__reduce_ex__(protocol)  # `torch.save(model.state_dict())` saves the values

    def __repr__(self, *, tensor_contents: object = None) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, {self.describe()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASING:
            return args[0].alias()
        if func is torch.ops.aten.is_pinned.default:
            return False
        for argument, value in _written(func, args, kwargs):
            if isinstance(value, StandIn):
                raise WriteRefused(
                    f"`{func.overloadpacket.__name__}` writes into its argument `{argument}`, which is "
                    f"{value.describe()}: a write would be lost; {value.remedy()}")
        device = next((t.device for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, Tensor) and not isinstance(t, StandIn)), None)
        args, kwargs = tree_map(lambda t: t.values(device) if isinstance(t, StandIn) else t, (args, kwargs))
        return func(*args, **kwargs)


def _written(func, args: tuple, kwargs: dict):
    """The arguments `func` writes into, by name, with their values."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            yield argument.name, value


def applied_dtype(fn, dtype: torch.dtype) -> torch.dtype:
    """What torch's `_apply(fn)` (`.half()`, `.to(torch.bfloat16)`, a device move) makes of a tensor of `dtype`: the
    dtype a stand-in follows, its values being made on demand. `dtype` itself where `fn` fails."""
    try:
        return fn(torch.empty(0, dtype=dtype)).dtype
    except Exception:  # the move itself raises it
        return dtype
