"""Building a model tree to load weights into, from what sits next to the weights.

A builder turns a model folder into a skeleton (parameters on meta). The default one reads a `config.json`: a
diffusers model's (`_class_name`) builds that diffusers class, any other is a transformers config, built as
`model_spec.auto_model` picks its class. Other node packs register builders for their own architectures with
`@register_builder`. Builders are tried newest first; the first that recognizes the folder wins. A caller who names
the class (`model_class`) needs no builder: the folder's config only has to describe it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..registry import Registry
from .build_dtype import BUILD_DTYPES
from .diffusers_model import diffusers_class_name, diffusers_model
from .model_spec import Built, ModelSpecError, auto_model, read_config
from .scoped import ContextPatch

Builder = Callable[[Path, torch.dtype | None], "nn.Module | Built | None"]
BUILDERS: Registry[Builder] = Registry("skeleton builder", order="newest-first")


def register_builder(builder: Builder) -> Builder:
    """Add a builder: `(folder, dtype) -> skeleton` (or a `Built`, which also says which class and why), or None when
    the folder is not its kind (tried newest first)."""
    return BUILDERS.register(f"{builder.__module__}.{builder.__qualname__}", builder)


def _on_meta(register: Callable, on_meta: Callable[[], bool | None]) -> Callable:
    def register_parameter(module: nn.Module, name: str, parameter) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta and on_meta():
            placeholder = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)
            placeholder._is_hf_initialized = True  # transformers' init functions skip it, as they skip loaded ones
            module._parameters[name] = placeholder

    return register_parameter


_PARAMETERS_ON_META = ContextPatch(nn.Module, "register_parameter", _on_meta)

_ON_META_FROM = 1 << 20
"""`torch.empty` calls of at least this many bytes, no device named, are made on meta in a skeleton."""


class _LargeEmptiesOnMeta(TorchFunctionMode):
    """Large `torch.empty` calls with no device made on meta, in this thread, while a skeleton is built.

    A layer allocates its parameters with `torch.empty` before registering them, so `_on_meta` replaces a real
    allocation: hundreds of MiB for a large model, freed at once but left in the C allocator's heap as untouched
    holes. Buffers the forwards allocate later wander over those holes, touching each, and glibc keeps what they free
    there: a Q8_0 GGUF whose weights are expanded at each call grew 70-150 MiB past its load that way, enough for the
    OOM killer under a memory cgroup. Buffers model code computes in `__init__` come from `arange`, `ones` and the
    like, or are small; one that is large, made by `torch.empty` and filled there, stays on meta, and `load` refuses
    it by name.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None and _empty_bytes(args, kwargs) >= _ON_META_FROM:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _empty_bytes(args: tuple, kwargs: dict) -> int:
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not all(isinstance(size, int) for size in shape):
        return 0
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return math.prod(shape) * dtype.itemsize


@contextmanager
def skeleton():
    """Build a model with its parameters on the meta device and its buffers real, in this thread (and context) only.

    Non-persistent buffers (rotary tables) are computed in `__init__` and are never in a checkpoint, so they must
    exist for real; parameters cost nothing until `load` fills them, not even a transient allocation where they are
    large (`_LargeEmptiesOnMeta`). A model built meanwhile in another thread gets real parameters
    (`scoped.ContextPatch`).
    """
    with _PARAMETERS_ON_META.active(True), _LargeEmptiesOnMeta():
        yield


def config_folder(path: Path) -> Path:
    """Where a model's config.json lives: the folder itself, or the folder holding a weight file."""
    return path if path.is_dir() else path.parent


def build_skeleton(folder: Path, dtype: torch.dtype | None = None) -> nn.Module:
    return built_skeleton(folder, dtype).model


def built_skeleton(folder: Path, dtype: torch.dtype | None = None, model_class: type | str | None = None) -> Built:
    """The folder's skeleton in eval mode, and which class it is and why: `model_class` (a class, or its name in the
    library whose config the folder holds) where given, else what the first builder that recognizes the folder built."""
    if dtype is not None and dtype not in BUILD_DTYPES:
        raise ModelSpecError(f"cannot build a model in {dtype}; choose one of {', '.join(map(str, BUILD_DTYPES))}")
    if model_class is not None:  # named by the caller: no builder has to recognize the folder
        built = _config_json(folder, dtype, model_class)
        if built is None:
            asked = getattr(model_class, "__name__", model_class)
            raise ModelSpecError(f"no config.json in {folder} to build `{asked}` from")
        return Built(built.model.eval(), built.how)
    for name, builder in BUILDERS.items():
        built = builder(folder, dtype)
        if built is not None:
            model, how = built if isinstance(built, Built) else (built, f"{type(built).__name__} (builder `{name}`)")
            return Built(model.eval(), how)
    raise ModelSpecError(f"no builder recognizes {folder}: expected a Hugging Face config.json beside the weights")


def model_type(folder: Path) -> str | None:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


@register_builder
def _config_json(folder: Path, dtype: torch.dtype | None, model_class: type | str | None = None) -> Built | None:
    """A diffusers model's config.json (`_class_name`) builds that diffusers class; any other is a transformers
    config."""
    if not (folder / "config.json").is_file():
        return None
    with skeleton():
        if diffusers_class_name(folder) is not None:
            return diffusers_model(folder, dtype, model_class)
        return auto_model(read_config(folder), dtype, model_class)
