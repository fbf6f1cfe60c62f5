"""What model code sees as a resident's `weight`: a stand-in of the float weight it quantizes.

A resident keeps its format's raw storage as its parameters (`weight` and, for INT8/INT4, `weight_scale`): that is
what moves, streams, pins, counts towards every budget and core's memory accounting, and what `state_dict`,
`deepcopy` and pickling hold. Model code reading `module.weight` gets a `QuantizedWeight` instead (the resident
class's `weight` property): its dtype the compute dtype (the float weight's, following `model.half()` and the like),
its shape the Linear's logical one, its device the storage's; a direct read (`F.linear(x, m.weight)`, `.T`,
`.float()`) dequantizes, a write is refused (`stand_in`). So transformers' T5 guard casts its activations to the
compute dtype, not to the storage's uint8. Made anew at each read (`m.weight is m.weight` is false), from the
module's current tensors; traceable by torch.compile (`__tensor_flatten__`), so a guard reading `.dtype` inside a
compiled block breaks no graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from ..engine import protocol
from ..engine.stand_in import StandIn
from .formats import FORMATS


class QuantizedWeight(StandIn):
    """The float weight a resident's stored tensors quantize, as model code sees it."""

    @staticmethod
    def __new__(cls, stored: dict[str, Tensor], format_name: str, attributes: tuple[tuple[str, object], ...],
                shape: tuple[int, ...], dtype: torch.dtype):
        tensor = StandIn.__new__(cls, shape, dtype, stored["weight"].device)
        for name, value in stored.items():  # attributes by name: how torch.compile takes a subclass apart
            setattr(tensor, name, value)
        tensor.names, tensor.format_name, tensor.attributes = tuple(stored), format_name, attributes
        return tensor

    @property
    def stored(self) -> dict[str, Tensor]:
        """The resident's stored tensors, by name (`weight`: the raw storage)."""
        return {name: getattr(self, name) for name in self.names}

    @classmethod
    def of(cls, module: nn.Module) -> QuantizedWeight:
        """What `module` (a resident) shows as its `weight` now: the resident class's `weight` property."""
        handler = protocol.quant_handler(module)
        shown = cls({name: module._parameters[name] for name in handler.stored}, handler.name,
                    tuple((name, _frozen(getattr(module, name))) for name in handler.attributes),
                    (module.out_features, module.in_features), module.__dict__[protocol.COMPUTE_DTYPE])
        shown.module_name = module.__dict__.get(protocol.NAME)  # for messages only
        return shown

    @property
    def nbytes(self) -> int:
        """The bytes it takes: its storage's (as comfy-kitchen's `QuantizedTensor` counts), never the float size."""
        return sum(tensor.nbytes for tensor in self.stored.values())

    def values(self, device: torch.device | None) -> Tensor:
        stored = {name: t if device is None else t.to(device) for name, t in self.stored.items()}
        return FORMATS[self.format_name].dequantize(SimpleNamespace(**dict(self.attributes)), stored, self.dtype)

    def alias(self) -> QuantizedWeight:
        return QuantizedWeight(self.stored, self.format_name, self.attributes, tuple(self.shape), self.dtype)

    module_name: str | None = None

    def describe(self) -> str:
        where = f"`{self.module_name}.weight`, " if self.module_name else ""
        return (f"{where}a `{self.format_name}` quantized weight (a Streamwise resident: its raw storage is the "
                "parameter)")

    def remedy(self) -> str:
        return ("keep the layer float in the policy (a quant rule that does not select it; for a head tied to the "
                "embedding, untie it with `config.tie_word_embeddings = False` first), or write its storage "
                "(`module._parameters`)")

    def __tensor_flatten__(self):
        return list(self.names), (self.format_name, self.attributes, tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], context: tuple, outer_size, outer_stride) -> QuantizedWeight:
        return QuantizedWeight(inner, *context)


def _frozen(value: object) -> object:
    """An attribute as a hashable constant (a compile guard compares it)."""
    return tuple(value) if isinstance(value, list) else value
