"""Quant formats: how a resident stores its weight and computes with it.

One handler per quant format of the policy vocabulary (`none` needs none), registered with `@quant_format`.
A handler names the tensors a resident streams (`stored`, in their raw dtype), turns a float weight into them
(`quantize`), turns them back (`dequantize`: the resident's forward does, to apply weight functions such as a
LoRA), and computes a linear layer straight from them (`linear`).

Adding a format, the whole contract:

    @quant_format("my_int8")          # the word must be in schemas.vocabulary.QUANT_FORMATS
    class MyInt8(QuantFormat):
        stored = ("weight", "weight_scale")
        def quantize(self, weight, group_size): ...        # float weight -> {"weight": ..., "weight_scale": ...}
        def dequantize(self, module, stored, dtype): ...   # -> the float weight
        def linear(self, module, x, stored, bias): ...     # optional: a fused kernel (default: dequantize + F.linear)

A `[[quant.rule]]` selecting Linear layers with `format = "my_int8"` then quantizes them on apply or load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..engine import protocol
from ..registry import Registry
from . import dequant_cache
from .int4 import dequantize_int4, int4_linear, quantize_int4
from .int8 import dequantize_int8, int8_linear, quantize_int8

FORMATS: Registry[QuantFormat] = Registry("quant format")


def quant_format(name: str):
    return FORMATS.decorator(name, lambda name, cls: cls(name))


class QuantFormat(ABC):
    stored: ClassVar[tuple[str, ...]] = ("weight",)
    attributes: ClassVar[tuple[str, ...]] = ()
    """The module attributes `dequantize` and `linear` read besides the stored tensors."""
    compile_safe: ClassVar[bool] = True
    quantizes_on_load: ClassVar[bool] = True

    def __init__(self, name: str) -> None:
        self.name = name

    def quantize(self, weight: Tensor, group_size: int | None) -> dict[str, Tensor]:
        raise TypeError(f"`{self.name}` residents come from a file, not from a float weight")

    @abstractmethod
    def dequantize(self, module: nn.Module, stored: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
        """The float weight, in the original basis."""

    def linear(self, module: nn.Module, x: Tensor, stored: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """Dequantize and multiply; a weight a forward asks for again comes from the process's dequant cache."""
        size = module.out_features * module.in_features * x.dtype.itemsize
        stored_now = [module._parameters[name] for name in self.stored]  # what a cached weight was made from
        weight = dequant_cache.DEQUANT_CACHE.weight(module, stored_now, x.dtype, x.device, size,
                                                    lambda: self.dequantize(module, stored, x.dtype))
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def dequantizes_to_a_view(self, module: nn.Module, dtype: torch.dtype) -> bool:
        """Whether `dequantize` returns the stored tensor itself, reinterpreted (decided without looking at data)."""
        return False

    def prepare(self, device: torch.device) -> None:
        """Make on `device` what the kernels read there besides the stored tensors, before a compiled graph is
        traced on it (default: nothing)."""
        return None


class _ScaledIntegers(QuantFormat):
    """Integer weights beside fp32 scales, worked by three kernels of one module (int8.py, int4.py)."""

    stored = ("weight", "weight_scale")
    attributes = (protocol.GROUP_SIZE,)
    kernels: ClassVar[tuple[Callable, Callable, Callable]]  # quantize, dequantize, linear

    def quantize(self, weight, group_size):
        q, scale = self.kernels[0](weight, group_size)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, module, stored, dtype):
        return self.kernels[1](stored["weight"], stored["weight_scale"], getattr(module, protocol.GROUP_SIZE), dtype)

    def linear(self, module, x, stored, bias):
        return self.kernels[2](x, stored["weight"], stored["weight_scale"], bias, getattr(module, protocol.GROUP_SIZE))


@quant_format("int8")
@quant_format("convrot_int8")
class Int8(_ScaledIntegers):
    kernels = (quantize_int8, dequantize_int8, int8_linear)


@quant_format("convrot_int4")
class ConvRotInt4(_ScaledIntegers):
    kernels = (quantize_int4, dequantize_int4, int4_linear)
    compile_safe = False


ARITHMETICS = ("int8", "float32")
"""How a GGUF resident computes on the CPU where a kernel reads its type's blocks directly (`gguf_matmul_cpu`):
`int8` (the default, the fastest): activations quantized per block as llama.cpp does, integer dot products with the
blocks; `float32`: the weight dequantized, then `F.linear` in float32 (exact, slower; the dequant cache holds what it
can). Other types and devices always take the float route."""


@quant_format("gguf")
class GGUF(QuantFormat):
    quantizes_on_load = False
    attributes = ("gguf_qtype", "gguf_shape")
    ARITHMETIC = "gguf_arithmetic"
    """The resident attribute naming its arithmetic (one of `ARITHMETICS`; absent: `int8`)."""

    def linear(self, module, x, stored, bias):
        blocks = stored["weight"]
        if not self.computes_blocks_directly(module.gguf_qtype, module.__dict__.get(self.ARITHMETIC), blocks.device,
                                             x.device):
            return super().linear(module, x, stored, bias)
        rows = x.reshape(-1, module.in_features)
        out = torch.ops.streamwise.gguf_matmul(rows, blocks, int(module.gguf_qtype), module.out_features)
        out = out.to(x.dtype).reshape(*x.shape[:-1], module.out_features)
        return out if bias is None else out + bias.to(x.dtype)

    @staticmethod
    def computes_blocks_directly(qtype: int, arithmetic: str | None, *devices: torch.device) -> bool:
        """Whether a resident of `qtype` computes with `gguf_matmul_cpu`'s kernels (none of its weight expanded):
        on the CPU, in the `int8` arithmetic, for a type they read, where numba is installed."""
        from . import gguf_dequant

        kernels = gguf_dequant.matmul_kernels()
        return (kernels is not None and arithmetic in (None, "int8") and qtype in kernels.TYPES
                and all(device.type == "cpu" for device in devices))

    def dequantize(self, module, stored, dtype):
        from . import gguf_dequant  # imported with the first GGUF resident: the gguf package costs 20 ms

        qtype = gguf_dequant.QType(module.gguf_qtype)
        return gguf_dequant.dequantize(stored["weight"], qtype, tuple(module.gguf_shape), dtype)

    def dequantizes_to_a_view(self, module, dtype):
        from . import gguf_dequant

        return gguf_dequant.STORED_FLOATS.get(gguf_dequant.QType(module.gguf_qtype)) == dtype

    def prepare(self, device):
        from . import gguf_dequant

        gguf_dequant.prepare(device)
