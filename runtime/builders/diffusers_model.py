"""Building a diffusers model folder's tree: its `config.json` names the class (`_class_name`), built from that config.

A diffusers model folder is what `ModelMixin.save_pretrained` writes: `config.json` beside
`diffusion_pytorch_model.safetensors` (sharded, or a variant such as `.fp16`; `weight_files` picks the file). A
pipeline folder (`model_index.json`) holds one per component. diffusers is optional: a folder that needs it and does
not find it says `pip install diffusers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..policy.diagnostics import did_you_mean
from .build_dtype import building_in
from .model_spec import Built, ModelSpecError


def diffusers_class_name(folder: Path) -> str | None:
    """The `_class_name` in the folder's config.json; None when the folder holds no diffusers model's config."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    name = config.get("_class_name") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def diffusers_model(folder: Path, dtype: torch.dtype | None, model_class: type | str | None = None) -> Built:
    """The class the folder's config names (or `model_class`, a diffusers model class or its name), built from that
    config in `dtype` for this thread only; the caller's context decides where parameters go (`skeleton`)."""
    name = diffusers_class_name(folder)
    try:
        import diffusers
    except ImportError:
        raise ModelSpecError(f"{folder}/config.json describes the diffusers model `{name}`; building it needs "
                             "diffusers: pip install diffusers") from None
    if model_class is None:
        cls, why = _model_class(diffusers, name), "diffusers `_class_name`"
    elif isinstance(model_class, type) and issubclass(model_class, diffusers.ModelMixin):
        cls, why = model_class, "asked for"
    elif isinstance(model_class, str):
        cls, why = _model_class(diffusers, model_class), "asked for"
    else:
        raise ModelSpecError(f"`model_class` must be a diffusers model class or its name for the diffusers folder "
                             f"{folder}, not {model_class!r}")
    try:
        config = cls.load_config(folder)
        with building_in(dtype):
            model = cls.from_config(config)
    except Exception as exc:  # the model's own code refusing its config, with any exception type
        raise ModelSpecError(f"diffusers cannot build `{cls.__name__}` from {folder}/config.json: "
                             f"{type(exc).__name__}: {exc}") from None
    return Built(model, f"{cls.__name__} ({why})")


def _model_class(diffusers, name: str) -> type:
    try:
        cls = getattr(diffusers, name, None) if name.isidentifier() else None
    except Exception as exc:  # diffusers' lazy import of that class failed (a dependency it needs is missing)
        raise ModelSpecError(f"diffusers cannot import `{name}`: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        guess = did_you_mean(name, [n for n in dir(diffusers) if n[:1].isupper()])
        raise ModelSpecError(f"diffusers has no model class `{name}`" + (f"; did you mean `{guess}`?" if guess else ""))
    return cls
