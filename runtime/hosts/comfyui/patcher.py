"""The ComfyUI host: streamed leaves fetch through core's `cast_bias_weight`, and
`model_patcher(model, ...)` hands a converted foreign tree to core's `ModelPatcher`.

Core is imported lazily and feature-detected, never pinned: older cores return two values from
`cast_bias_weight`; newer ones take `offloadable=True` and want `uncast_bias_weight` after the
op, and provide `archive_model_dtypes` and `CoreModelPatcher`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ....schemas import Policy
from ...engine.apply import ConversionError, applied_state, apply_policy, swap_class
from ...engine.classes import picklable
from ...quant.residents import MERGED_PATCH


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
        return [None if (t := getattr(module, name)) is None else self._cast_to(t, None, device, non_blocking=True) for name in names]


def model_patcher(
    model: nn.Module,
    *,
    load_device: torch.device,
    offload_device: torch.device,
    policy: Policy | str | None = None,
):
    """A ComfyUI `ModelPatcher` for a converted tree (converted here first when `policy` is given).

    The patcher sees the model's own state-dict keys, so `add_patches` (LoRA) addresses them;
    loads tell the tree its compute device, and unloads send relocated tensors back.
    """
    import comfy.model_patcher

    policy = _host(model, policy)
    base = getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher)
    return _armed(_patcher_class(base)(model, load_device=load_device, offload_device=offload_device), policy)


def adopt(patcher: Any, policy: Policy | str) -> Any:
    """A clone of a MODEL another pack loaded, its tree converted by `policy` and hosted here.

    The clone keeps everything ComfyUI's `clone` carries (LoRA patches, object patches, wrappers,
    callbacks, options); only its class gains this host's load and unload steps.
    """
    policy = _host(patcher.model, policy)
    adopted = patcher.clone()
    adopted.__class__ = _patcher_class(type(patcher))
    return _armed(adopted, policy)


def _host(model: nn.Module, policy: Policy | str | None) -> Policy | None:
    """Convert `model` (when given a policy) and make its tree fetch through ComfyUI."""
    import comfy.model_management

    if policy is not None:
        policy, _ = apply_policy(model, policy)
    state = applied_state(model)
    if state is None:
        raise ConversionError("convert the model first (streamwise.apply) or pass policy=")
    state.tree.fetcher = ComfyFetcher()
    if not isinstance(type(model).__dict__.get("device"), _SettableDevice):
        state.records.append(swap_class(model, _patchable_class(type(model)), {}, "host"))
    archive = getattr(comfy.model_management, "archive_model_dtypes", None)
    if archive is not None:
        archive(model)  # pins each tensor's storage dtype where newer cores read it
    return policy


def _armed(patcher: Any, policy: Policy | None) -> Any:
    if policy is not None and policy.compile.enabled:
        from ...compile.arm import lazy_compile

        return lazy_compile(patcher, policy)
    return patcher


class _SettableDevice:
    """ModelPatcher assigns `model.device`; transformers models make it a read-only property."""

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        if "_sw_device" in instance.__dict__:
            return instance.__dict__["_sw_device"]
        return self.fallback.__get__(instance, owner) if hasattr(self.fallback, "__get__") else self.fallback

    def __set__(self, instance, value) -> None:
        instance.__dict__["_sw_device"] = value


_PATCHABLE: dict[type, type] = {}
_PATCHERS: dict[type, type] = {}


def _patchable_class(cls: type) -> type:
    if cls not in _PATCHABLE:
        fallback = inspect.getattr_static(cls, "device", None)
        _PATCHABLE[cls] = type(cls.__name__, (cls,), {
            "device": _SettableDevice(fallback),
            "__module__": cls.__module__,
            "_sw_original_class": getattr(cls, "_sw_original_class", cls),
            **picklable(_patchable_class, cls),
        })
    return _PATCHABLE[cls]


def _patcher_class(base: type) -> type:
    if base not in _PATCHERS:

        def load(self, device_to=None, *args, **kwargs):
            _tree(self).compute_device = device_to if device_to is not None else self.load_device
            return base.load(self, device_to, *args, **kwargs)

        def partially_unload(self, device_to, *args, **kwargs):
            freed = base.partially_unload(self, device_to, *args, **kwargs)
            for module in self.model.modules():
                merged = module.__dict__.get(MERGED_PATCH)
                if merged is not None and not module.__dict__.get("comfy_patched_weights", False):
                    del module.__dict__[MERGED_PATCH]
                    if not any(getattr(f, "key", None) == merged.key for f in module.weight_function):
                        module.weight_function = [*module.weight_function, merged]  # force-patched: keep it applied
            _tree(self).offload_relocated(device_to)
            return freed

        def unpatch_model(self, device_to=None, *args, **kwargs):
            unpatch_weights = kwargs.get("unpatch_weights", args[0] if args else True)
            result = base.unpatch_model(self, device_to, *args, **kwargs)
            if unpatch_weights:
                for module in self.model.modules():
                    module.__dict__.pop(MERGED_PATCH, None)
            if device_to is not None:
                _tree(self).offload_relocated(device_to)
            return result

        def patch_weight_to_device(self, key, device_to=None, inplace_update=False, *args, **kwargs):
            module_path, _, name = key.rpartition(".")
            module = self.model.get_submodule(module_path)
            if name != "weight" or not hasattr(type(module), "_sw_format"):
                return base.patch_weight_to_device(self, key, device_to, inplace_update, *args, **kwargs)
            if key in self.patches:
                # Raw quantized storage cannot take a merged patch: the resident applies it on the fly
                # for as long as core counts the weight as patched (`comfy_patched_weights`).
                import comfy.model_patcher

                module.__dict__[MERGED_PATCH] = comfy.model_patcher.LowVramPatch(key, self.patches)

        _PATCHERS[base] = type(f"Streamwise{base.__name__}", (base,), {
            "__module__": __name__,
            "__doc__": "A ModelPatcher that keeps a Streamwise tree's compute device and relocated tensors in step.",
            "load": load,
            "partially_unload": partially_unload,
            "unpatch_model": unpatch_model,
            "patch_weight_to_device": patch_weight_to_device,
        })
    return _PATCHERS[base]


def _tree(patcher):
    return applied_state(patcher.model).tree
