"""Fetching through core: streamed leaves get their weights from `comfy.ops.cast_bias_weight`.

Core is imported on first use and feature-detected, never pinned: older cores return two values from
`cast_bias_weight`; newer ones take `offloadable=True` and want `uncast_bias_weight` after the op.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ...convert import ConversionError
from ...engine import file_tier, protocol
from ...engine.file_tier import FileTensor
from ...engine.tree import cast_for_compute
from ...plan.selectors import joined


class ComfyFetcher:
    """Fetch through `comfy.ops.cast_bias_weight`, which also applies LoRA `LowVramPatch` functions.

    Core patches a weight by its state-dict key: merged in place where it loads the module whole, through the
    module's weight functions where it streams it. It looks only at modules whose parameters are all their own, so a
    generic container (and what it claims, where core left it unmerged) would compute with unpatched tensors: for
    those, `fetch_parameters` applies the loading patcher's patches (`patches`) by key as it fetches.
    """

    def __init__(self, paths: dict[int, str]) -> None:
        import comfy.model_management
        import comfy.model_patcher
        import comfy.ops

        if not isinstance(getattr(comfy.ops.CastWeightBiasOp, "weight_function", None), list):
            raise ConversionError("this ComfyUI core predates list-valued weight functions (v0.3.15); update ComfyUI")
        self._cast = comfy.ops.cast_bias_weight
        self._offloadable = "offloadable" in inspect.signature(self._cast).parameters
        self._uncast = getattr(comfy.ops, "uncast_bias_weight", None)
        self._cast_to = comfy.model_management.cast_to
        # core's offload streams, where it has them (both cores here do; CUDA and XPU only: None elsewhere)
        self._offload_stream = getattr(comfy.model_management, "get_offload_stream", lambda device: None)
        self._sync_stream = getattr(comfy.model_management, "sync_stream", lambda device, stream: None)
        self._patch = comfy.model_patcher.LowVramPatch
        self._paths = paths  # by module id: its path in the tree, the prefix of its parameters' keys
        self.patches: dict[str, list] | None = None
        """The patches of the patcher that loaded the tree, by key (None once it is unpatched)."""

    def fetch(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None):
        """Per forward of every streamed leaf: keep it cheap."""
        weight, bias = module.weight, module.bias
        if weight is None and bias is None:  # a norm without affine parameters: nothing to fetch
            return None, None, None
        if isinstance(weight, FileTensor) or isinstance(bias, FileTensor):  # in the file: read it,
            weight, bias = file_tier.held(module, "weight"), file_tier.held(module, "bias")  # then cast as core does
            return (cast_for_compute(weight, device, dtype, protocol.weight_functions(module)),
                    cast_for_compute(bias, device, dtype, protocol.bias_functions(module)), None)
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
        """Raw storage through core's `cast_to` (`cast_bias_weight` would recast and patch it), on core's offload
        stream as its own layers' weights: the compute stream waits for the copies, not the host."""
        stream = self._offload_stream(device)
        fetched = [None if (t := file_tier.held(module, name)) is None
                   else self._cast_to(t, None, device, non_blocking=True, stream=stream) for name in names]
        self._sync_stream(device, stream)
        return fetched

    def fetch_parameters(self, module: nn.Module, names: tuple[str, ...], device: torch.device):
        """`fetch_raw`, each tensor with the loading patcher's patches for its key unless core merged them into the
        module already (`comfy_patched_weights`): a patch computes on a copy, never on the stored tensor."""
        patches = self.patches
        if not patches or module.__dict__.get(protocol.PATCHED_FLAG, False) or protocol.is_resident(module):
            return self.fetch_raw(module, names, device)  # a resident keeps its patch beside its raw storage
        prefix = self._paths[id(module)]
        stream = self._offload_stream(device)
        copied = [None if (t := file_tier.held(module, name)) is None else
                  self._cast_to(t, None, device, non_blocking=True, copy=joined(prefix, name) in patches, stream=stream)
                  for name in names]
        self._sync_stream(device, stream)  # the patches compute on the compute stream, after the copies
        return [tensor if tensor is None or (key := joined(prefix, name)) not in patches
                else self._patch(key, patches)(tensor) for name, tensor in zip(names, copied, strict=True)]

    def around_block(self, block: nn.Module):
        return nullcontext()  # core fetches inline, inside the graph

    def expansion(self, nbytes: int, device: torch.device) -> None:
        return None  # core's memory accounting sizes what a forward allocates: expansions stay its allocations
