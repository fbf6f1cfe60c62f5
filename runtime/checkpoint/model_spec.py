"""Build a model tree on the meta device from a short spec, for `policy-validate --model`.

Specs:
- `transformers:Qwen2ForCausalLM`: a transformers class with its default (full-size) config;
- `transformers:qwen2`: a config `model_type`, built with the causal-LM auto class where one
  exists and the base auto class otherwise;
- `package.module:factory`: a Python callable returning an `nn.Module` (this imports your code:
  the model is yours, unlike a policy, which is only ever read).
Config overrides (a small JSON object) apply to the transformers forms.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..policy.diagnostics import did_you_mean
from .build_dtype import BUILD_DTYPES, building_in


class ModelSpecError(ValueError):
    pass


def read_config(folder: str | os.PathLike):
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers rejects bad fields with its own validation error types too
        raise ModelSpecError(f"cannot read {folder}/config.json: {exc}") from None


def auto_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The causal-LM model for a transformers config where one exists, else the base model, built in `dtype`
    (default: the config's `dtype`) for this thread only (`build_dtype`).

    transformers reports a dtype it cannot build in as a ValueError, which would read as "no auto class builds this
    model", so the config's dtype is checked first; and it would switch the process's default dtype to build in one,
    so it is handed none and the dtype is recorded on the config afterwards, as it records it."""
    import transformers

    stored = getattr(config, "dtype", None)
    stored = getattr(torch, stored, stored) if isinstance(stored, str) else stored
    if stored is not None and stored not in BUILD_DTYPES:
        choices = ", ".join(str(d).removeprefix("torch.") for d in BUILD_DTYPES)
        raise ModelSpecError(
            f"the config's `dtype` {str(stored).removeprefix('torch.')} is not a floating dtype a model can be built "
            f"in; set `dtype` (or `torch_dtype`) in config.json to one of {choices}"
        )
    dtype = dtype or stored
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            with building_in(dtype):
                model = auto.from_config(config, dtype=None)
        except ValueError:
            continue
        for built in (model.config, *(getattr(model.config, key) for key in model.config.sub_configs)):
            if built is not None:
                built.dtype = dtype
        return model
    raise ModelSpecError(f"no transformers auto class builds model_type `{config.model_type}`")


def build_model(spec: str, overrides: dict[str, Any] | None = None) -> nn.Module:
    source, _, name = spec.partition(":")
    if not source or not name:
        raise ModelSpecError(
            f"`{spec}` is not a model spec: use `transformers:<Class or model_type>` or `module:factory`"
        )
    if overrides is not None and not isinstance(overrides, dict):
        raise ModelSpecError(f"the config overrides must be a JSON object, not {type(overrides).__name__}")
    with torch.device("meta"):
        model = _transformers(name, overrides or {}) if source == "transformers" else _factory(source, name, overrides)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"`{spec}` built a {type(model).__name__}, not a torch.nn.Module")
    return model


def _transformers(name: str, overrides: dict[str, Any]) -> nn.Module:
    import transformers

    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) and name not in transformers.CONFIG_MAPPING:
        guess = did_you_mean(name, [*transformers.CONFIG_MAPPING, *_model_class_names(transformers)])
        raise ModelSpecError(
            f"transformers has no model class or model_type `{name}`" + (f"; did you mean `{guess}`?" if guess else "")
        )
    if cls is not None and getattr(cls, "config_class", None) is None:
        raise ModelSpecError(f"`{name}` is not a transformers model class (it has no config class)")
    try:  # a config transformers accepts may still fail in the model's own code (a zero head count)
        defaults = cls.config_class() if cls is not None else transformers.AutoConfig.for_model(name)
        _check_keys(overrides, [*defaults.to_dict(), *defaults.attribute_map], f"the `{name}` config")
        if cls is not None:
            return cls(cls.config_class(**overrides))
        return auto_model(transformers.AutoConfig.for_model(name, **overrides))
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(
            f"transformers cannot build `{name}` with this config: {type(exc).__name__}: {exc}"
        ) from None


def _model_class_names(transformers) -> list[str]:
    """transformers' public model class names (`...Model`, `...For...`), for a did-you-mean on a misspelled one."""
    return [name for name in dir(transformers) if name[:1].isupper() and ("For" in name or name.endswith("Model"))]


def _check_keys(overrides: dict[str, Any], known: list[str], what: str) -> None:
    """A config key nothing reads would be ignored silently (a misspelled `num_hiden_layers` builds the full model)."""
    for key in overrides:
        if key not in known:
            guess = did_you_mean(key, known)
            raise ModelSpecError(f"{what} has no key `{key}`" + (f"; did you mean `{guess}`?" if guess else ""))


def _factory(module_name: str, attribute: str, overrides: dict[str, Any] | None) -> nn.Module:
    try:
        with _importable_from(os.getcwd()):  # `my_models:build` beside the user, as `python -c` would find it
            factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ModelSpecError(f"cannot find `{module_name}:{attribute}`: {exc}") from None
    parameters = _keyword_parameters(factory)
    if overrides and parameters is not None:
        _check_keys(overrides, parameters, f"`{module_name}:{attribute}`")
    try:
        return factory(**overrides) if overrides else factory()
    except Exception as exc:  # the overrides do not fit the factory, or the factory itself fails
        raise ModelSpecError(
            f"cannot call `{module_name}:{attribute}` with this config: {type(exc).__name__}: {exc}"
        ) from None


@contextlib.contextmanager
def _importable_from(folder: str) -> Iterator[None]:
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added:
            sys.path.remove(folder)


def _keyword_parameters(factory: object) -> list[str] | None:
    """The keywords `factory` takes, or None when it takes any (`**kwargs`) or its signature is unknown."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                      inspect.Parameter.KEYWORD_ONLY)]
