"""Building a model tree to load weights into, from what sits next to the weights.

A builder turns a model folder into a skeleton (parameters on meta). The default one reads a
Hugging Face `config.json` and uses transformers' auto classes; other node packs register
builders for their own architectures with `@register_builder`. Builders are tried newest first;
the first that recognizes the folder wins.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..registry import Registry
from .build_dtype import BUILD_DTYPES
from .model_spec import ModelSpecError, auto_model, read_config
from .scoped import ContextPatch

Builder = Callable[[Path, torch.dtype | None], "nn.Module | None"]
BUILDERS: Registry[Builder] = Registry("skeleton builder", order="newest-first")


def register_builder(builder: Builder) -> Builder:
    """Add a builder: `(folder, dtype) -> skeleton`, or None when the folder is not its kind (tried newest first)."""
    return BUILDERS.register(f"{builder.__module__}.{builder.__qualname__}", builder)



def _on_meta(register: Callable, on_meta: Callable[[], bool | None]) -> Callable:
    def register_parameter(module: nn.Module, name: str, parameter) -> None:
        register(module, name, parameter)
        if parameter is not None and not parameter.is_meta and on_meta():
            module._parameters[name] = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

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
    if dtype is not None and dtype not in BUILD_DTYPES:
        raise ModelSpecError(f"cannot build a model in {dtype}; choose one of {', '.join(map(str, BUILD_DTYPES))}")
    for builder in BUILDERS.values():
        model = builder(folder, dtype)
        if model is not None:
            return model.eval()
    raise ModelSpecError(f"no builder recognizes {folder}: expected a Hugging Face config.json beside the weights")


def model_type(folder: Path) -> str | None:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


@register_builder
def _transformers(folder: Path, dtype: torch.dtype | None) -> nn.Module | None:
    if not (folder / "config.json").is_file():
        return None
    config = read_config(folder)
    with skeleton():
        return auto_model(config, dtype)
