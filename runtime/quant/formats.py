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
        def dequantize(self, module, stored, dtype, out=None): ...  # -> the float weight (into `out`'s bytes)
        def linear(self, module, x, stored, bias): ...     # optional: a fused kernel (default: dequantize + F.linear)
        expands_at_call = False                            # with a `linear` of its own that expands nothing

A `[[quant.rule]]` selecting Linear layers with `format = "my_int8"` then quantizes them on apply or load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..engine import protocol
from ..engine.tracing import plain_call
from ..registry import Registry
from . import dequant_cache, numba_kernels
from .convrot import rotate
from .errors import QuantError
from .int4 import dequantize_int4, int4_linear, quantize_int4, scale_group_for
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
    expands_at_call: ClassVar[bool] = True
    """Whether `linear` expands the weight through `dequantize` where it does not compute directly (into the tree's
    reused expansion buffer where it has one): the formats with kernels of their own say no."""

    def __init__(self, name: str) -> None:
        self.name = name

    def quantize(self, weight: Tensor, group_size: int | None) -> dict[str, Tensor]:
        raise QuantError(f"`{self.name}` residents come from a file, not from a float weight")

    @abstractmethod
    def dequantize(self, module: nn.Module, stored: dict[str, Tensor], dtype: torch.dtype,
                   out: Tensor | None = None) -> Tensor:
        """The float weight, in the original basis; written into `out` (uint8 bytes, at least the weight's) where
        given, else into memory of its own."""

    def linear(self, module: nn.Module, x: Tensor, stored: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """Dequantize and multiply: into the tree's reused expansion buffer where it has one on x's device (what
        nothing records: no gradient, tracer or graph keeps the weight past the matmul that reads it, before the next
        expansion writes it, on the same stream), else a weight a forward asks for again comes from the process's
        dequant cache."""
        size = module.out_features * module.in_features * x.dtype.itemsize
        tree = protocol.tree_of(module)
        room = tree.fetcher.expansion(size, x.device) if tree is not None and plain_call(x) else None
        if room is not None:
            weight = self.dequantize(module, stored, x.dtype, out=room)
        else:
            stored_now = [module._parameters[name] for name in self.stored]  # what a cached weight was made from
            weight = dequant_cache.DEQUANT_CACHE.weight(module, stored_now, x.dtype, x.device, size,
                                                        lambda: self.dequantize(module, stored, x.dtype))
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def dequantizes_to_a_view(self, module: nn.Module, dtype: torch.dtype) -> bool:
        """Whether `dequantize` returns the stored tensor itself, reinterpreted (decided without looking at data)."""
        return False

    def computes_directly(self, attributes: Mapping[str, object], *devices: torch.device) -> bool:
        """Whether a resident with these attributes (its `__dict__`, or a load's for it) computes on `devices` with a
        kernel that reads its storage in place (`cpu_matmul`), expanding nothing; else `linear` expands it."""
        return False

    def cpu_arithmetic(self, module: nn.Module) -> str:
        """How `module`, a resident, computes on the CPU: `int8` where a kernel reads its storage, else `float32`."""
        return "int8" if self.computes_directly(module.__dict__, torch.device("cpu")) else "float32"

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

    expands_at_call = False  # `linear` is the kernels' own

    def dequantize(self, module, stored, dtype, out=None):
        weight = self.kernels[1](stored["weight"], stored["weight_scale"], getattr(module, protocol.GROUP_SIZE), dtype)
        return weight if out is None else _into(out, weight)

    def linear(self, module, x, stored, bias):
        return self.kernels[2](x, stored["weight"], stored["weight_scale"], bias, getattr(module, protocol.GROUP_SIZE))


@quant_format("int8")
@quant_format("convrot_int8")
class Int8(_ScaledIntegers):
    kernels = (quantize_int8, dequantize_int8, int8_linear)

    def cpu_arithmetic(self, module):
        return "bf16" if module.in_features % 16 == 0 else "float32"  # torch's packed kernel (`int8.int8_linear`)


@quant_format("convrot_int4")
class ConvRotInt4(_ScaledIntegers):
    kernels = (quantize_int4, dequantize_int4, int4_linear)
    compile_safe = False

    def linear(self, module, x, stored, bias):
        if not (self.computes_directly(module.__dict__, x.device, stored["weight"].device) and plain_call(x)):
            return super().linear(module, x, stored, bias)  # no operator: neither a tracer nor autograd would see it
        kernels = numba_kernels.matmul()
        group_size, shape = getattr(module, protocol.GROUP_SIZE), (module.out_features, -1)
        rows = rotate(x, group_size).reshape(-1, module.in_features)
        return _with_bias(kernels.matmul(rows, stored["weight"], kernels.CONVROT_INT4, module.out_features,
                                         stored["weight_scale"].view(shape)), x, bias)

    def computes_directly(self, attributes, *devices):
        from .cpu_matmul import CONVROT_INT4, LAYOUTS

        return (_direct(attributes, devices)
                and scale_group_for(attributes[protocol.GROUP_SIZE]) == LAYOUTS[CONVROT_INT4].block_size)


ARITHMETICS = ("int8", "float32")
"""How a resident computes on the CPU where a kernel reads its storage in place (`cpu_matmul`: GGUF's Q8_0, Q4_0,
Q4_K, Q5_K, Q6_K, and ConvRot INT4): `int8` (the default, the fastest), activations quantized per block as llama.cpp
does, integer dot products with the stored values; `float32`, the weight expanded, then `F.linear` in float32 (exact,
slower; the dequant cache holds what it can). Other types and devices always take the float route."""


def _direct(attributes, devices) -> bool:
    """The conditions every in-place kernel shares: numba's kernels built, the `int8` arithmetic, the CPU."""
    return (numba_kernels.matmul() is not None and attributes.get(protocol.ARITHMETIC, "int8") == "int8"
            and all(device.type == "cpu" for device in devices))


def _into(out: Tensor, weight: Tensor) -> Tensor:
    """`weight` copied into the bytes `out`, as a tensor of its shape and dtype there."""
    return out[: weight.nbytes].view(weight.dtype).view(weight.shape).copy_(weight)


def _with_bias(out: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
    """A kernel's float32 (rows, out) as the layer's output: x's dtype and leading dims, the bias added."""
    out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias.to(x.dtype)


@quant_format("gguf")
class GGUF(QuantFormat):
    quantizes_on_load = False
    attributes = ("gguf_qtype", "gguf_shape")

    def linear(self, module, x, stored, bias):
        blocks = stored["weight"]
        rows = x.reshape(-1, module.in_features)
        if not self.computes_directly(module.__dict__, x.device, blocks.device):
            from . import gguf_dequant

            out = None
            if rows.is_cuda:  # a few rows multiply the blocks directly (decode)
                out = gguf_dequant.gpu_matmul(rows, blocks, gguf_dequant.QType(module.gguf_qtype), module.out_features)
            return super().linear(module, x, stored, bias) if out is None else _with_bias(out, x, bias)
        if plain_call(x):  # native code: the operator's dispatch costs about 0.1 ms, a decode step one per Linear
            out = numba_kernels.matmul().matmul(rows, blocks, module.gguf_qtype, module.out_features)
        else:
            out = torch.ops.streamwise.gguf_matmul(rows, blocks, int(module.gguf_qtype), module.out_features)
        return _with_bias(out, x, bias)

    def computes_directly(self, attributes, *devices):
        return _direct(attributes, devices) and attributes["gguf_qtype"] in numba_kernels.matmul().LAYOUTS

    def dequantize(self, module, stored, dtype, out=None):
        from . import gguf_dequant  # imported with the first GGUF resident: the gguf package costs 20 ms

        qtype = gguf_dequant.QType(module.gguf_qtype)
        return gguf_dequant.dequantize(stored["weight"], qtype, tuple(module.gguf_shape), dtype, out=out)

    def dequantizes_to_a_view(self, module, dtype):
        from . import gguf_dequant

        return gguf_dequant.STORED_FLOATS.get(gguf_dequant.QType(module.gguf_qtype)) == dtype

    def prepare(self, device):
        from . import gguf_dequant

        gguf_dequant.prepare(device)
