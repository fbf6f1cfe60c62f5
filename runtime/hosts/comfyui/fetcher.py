"""Fetching through core: streamed leaves get their weights from `comfy.ops.cast_bias_weight`.

Core is imported on first use and feature-detected, never pinned: older cores return two values from
`cast_bias_weight`; newer ones take `offloadable=True` and want `uncast_bias_weight` after the op.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ...engine import ConversionError


class ComfyFetcher:
    """Fetch through `comfy.ops.cast_bias_weight`, which also applies LoRA `LowVramPatch` functions."""

    def __init__(self) -> None:
        import comfy.model_management
        import comfy.ops

        if not isinstance(getattr(comfy.ops.CastWeightBiasOp, "weight_function", None), list):
            raise ConversionError("this ComfyUI core predates list-valued weight functions (v0.3.15); update ComfyUI")
        self._cast = comfy.ops.cast_bias_weight
        self._offloadable = "offloadable" in inspect.signature(self._cast).parameters
        self._uncast = getattr(comfy.ops, "uncast_bias_weight", None)
        self._cast_to = comfy.model_management.cast_to

    def fetch(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None):
        """Per forward of every streamed leaf: keep it cheap."""
        weight, bias = module.weight, module.bias
        if weight is None and bias is None:  # a norm without affine parameters: nothing to fetch
            return None, None, None
        options: dict[str, Any] = {
            "dtype": dtype or (weight.dtype if weight is not None else None),
            "device": device,
            "bias_dtype": dtype or (bias.dtype if bias is not None else None),
        }
        if self._offloadable:
            return self._cast(module, None, offloadable=True, **options)
        weight, bias = self._cast(module, None, **options)
        return weight, bias, None

    def release(self, module: nn.Module, weight, bias, handle) -> None:
        if self._offloadable and self._uncast is not None:
            self._uncast(module, weight, bias, handle)

    def fetch_raw(self, module: nn.Module, names: tuple[str, ...], device: torch.device):
        """Raw storage through core's `cast_to`: `cast_bias_weight` would recast and patch it."""
        return [None if (t := getattr(module, name)) is None else self._cast_to(t, None, device, non_blocking=True)
                for name in names]

    def inline_for_compile(self) -> None:
        pass  # core fetches inline already
