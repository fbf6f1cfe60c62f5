"""Building a model tree to load weights into, from what sits next to the weights.

A builder turns a model folder into a skeleton (parameters on meta). The default one reads a `config.json`: a
diffusers model's (`_class_name`) builds that diffusers class, any other is a transformers config, built as
`model_spec.auto_model` picks its class. Other node packs register builders for their own architectures with
`@register_builder`. Builders are tried newest first; the first that recognizes the folder wins. A caller who names
the class (`model_class`) needs no builder: the folder's config only has to describe it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

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


def skeleton():
    """Build a model with its parameters on the meta device and its buffers real, in this thread (and context) only.

    Non-persistent buffers (rotary tables) are computed in `__init__` and are never in a checkpoint, so they must
    exist for real; parameters cost nothing until `load` fills them. A model built meanwhile in another thread
    gets real parameters (`scoped.ContextPatch`).
    """
    return _PARAMETERS_ON_META.active(True)


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
