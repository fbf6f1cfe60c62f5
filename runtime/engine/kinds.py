"""Compute kinds: how a streamed leaf computes once its weights are on the compute device.

Each kind named in `schemas.vocabulary.COMPUTE_KINDS` has one handler here, registered with `@compute_kind`
(a test checks every word has one). A handler receives the module, the input and the fetched `weight`/`bias`
and computes exactly what the original class computes from its own tensors, so a streamed forward is
bit-identical to the original one on the same device.

`dtype` says which dtype the weights are fetched in: `"input"` for ops that require the activation's dtype
(linear, convolutions), `"stored"` where the original computes with the weight's own dtype (embeddings, norms
that promote or upcast themselves).

The leaf-kind contract (`streamed.streaming_class` drives it; quantized residents implement it too):
`resident_forward(cls)` is the forward while the weights are resident, `fetch(fetcher, module, x)` brings them
for one call, `compute(module, x, fetched, *args, **kwargs)` computes with them and `release(...)` lets them go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..registry import Registry
from . import protocol

WeightDtype = Literal["input", "stored"]
Function = Callable[..., Tensor]


@dataclass(frozen=True)
class ComputeKind:
    name: str
    function: Function
    dtype: WeightDtype
    requires: tuple[str, ...]

    def missing(self, module: nn.Module) -> list[str]:
        """Attributes the handler needs that `module` lacks (checked before any conversion)."""
        return [name for name in self.requires if not protocol.has_attribute(module, name)]

    def resident_forward(self, cls: type[nn.Module]) -> Callable[..., Any]:
        return cls.forward

    def fetch(self, fetcher: Any, module: nn.Module, x: Tensor) -> tuple:
        return fetcher.fetch(module, x.device, x.dtype if self.dtype == "input" else None)

    def compute(self, module: nn.Module, x: Tensor, fetched: tuple, *args, **kwargs) -> Tensor:
        weight, bias, _ = fetched
        return self.function(module, x, weight, bias, *args, **kwargs)

    def release(self, fetcher: Any, module: nn.Module, fetched: tuple) -> None:
        fetcher.release(module, *fetched)


COMPUTE_KINDS: Registry[ComputeKind] = Registry("compute kind")


def compute_kind(name: str, *, dtype: WeightDtype, requires: tuple[str, ...] = ("weight",)):
    return COMPUTE_KINDS.decorator(name, lambda name, function: ComputeKind(name, function, dtype, requires))


_CONV = ("weight", "bias", "_conv_forward")
_CONV_T = ("weight", "bias", "stride", "padding", "groups", "dilation", "_output_padding", "kernel_size")
_EMBEDDING = ("weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


@compute_kind("linear", dtype="input", requires=("weight", "bias"))
def _linear(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


@compute_kind("embedding", dtype="stored", requires=_EMBEDDING)
def _embedding(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.embedding(
        x, weight, module.padding_idx, module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse
    )


@compute_kind("conv1d", dtype="input", requires=_CONV)
@compute_kind("conv2d", dtype="input", requires=_CONV)
@compute_kind("conv3d", dtype="input", requires=_CONV)
def _conv(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return module._conv_forward(x, weight, bias)


def _conv_transpose(functional: Callable[..., Tensor], spatial_dims: int) -> Function:
    def compute(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None, output_size=None) -> Tensor:
        if module.padding_mode != "zeros":
            raise ValueError(f"only `zeros` padding mode is supported for {type(module).__name__}")
        output_padding = module._output_padding(
            x, output_size, module.stride, module.padding, module.kernel_size, spatial_dims, module.dilation
        )
        return functional(
            x, weight, bias, module.stride, module.padding, output_padding, module.groups, module.dilation
        )

    return compute


compute_kind("conv_transpose1d", dtype="input", requires=_CONV_T)(_conv_transpose(F.conv_transpose1d, 1))
compute_kind("conv_transpose2d", dtype="input", requires=_CONV_T)(_conv_transpose(F.conv_transpose2d, 2))


@compute_kind("layer_norm", dtype="stored", requires=("weight", "bias", "normalized_shape", "eps"))
def _layer_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)


@compute_kind("group_norm", dtype="stored", requires=("weight", "bias", "num_groups", "eps"))
def _group_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return F.group_norm(x, module.num_groups, weight, bias, module.eps)


@compute_kind("rms_norm", dtype="stored", requires=("weight", "normalized_shape", "eps"))
def _rms_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return F.rms_norm(x, module.normalized_shape, weight, module.eps)


def _llama_rms(module: nn.Module, x: Tensor, weight: Tensor | None) -> Tensor:
    """fp32 statistics, cast back to the input dtype, then scale (transformers' LlamaRMSNorm)."""
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = hidden.to(input_dtype)
    return hidden if weight is None else weight * hidden


@compute_kind("llama_rms_norm", dtype="stored")
def _llama_rms_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return _llama_rms(module, x, weight)


@compute_kind("conv_rms_norm", dtype="stored")
def _conv_rms_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return _llama_rms(module, x.transpose(1, 2), weight).transpose(1, 2)


@compute_kind("conv_layer_norm", dtype="stored", requires=("weight", "bias", "normalized_shape", "eps"))
def _conv_layer_norm(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """VibeVoice's ConvLayerNorm: channels last, fp32 layer norm, back to the input dtype."""
    hidden = x.transpose(1, 2)
    hidden = F.layer_norm(hidden.float(), module.normalized_shape, weight.float(), bias.float(), module.eps)
    return hidden.type_as(x).transpose(1, 2)
