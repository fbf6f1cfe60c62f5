"""Build a model tree on the meta device from a short spec, for `policy-validate --model`.

Specs:
- `transformers:Qwen2ForCausalLM`: a transformers class with its default (full-size) config;
- `transformers:qwen2`: a config `model_type`, built as `auto_model` picks its class (the causal LM where
  transformers has one, else the first generating task's, else the base model);
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
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ...errors import Error
from ..policy.diagnostics import did_you_mean
from .build_dtype import BUILD_DTYPES, building_in


class ModelSpecError(Error, ValueError):
    pass


def read_config(folder: str | os.PathLike):
    """The folder's transformers config, built by transformers' own classes only: never the folder's code."""
    import transformers

    refuse_remote_code(folder, "config.json", "AutoConfig")
    try:
        return transformers.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers rejects bad fields with its own validation error types too
        code = _remote_config(folder)
        if code is None:
            raise ModelSpecError(f"cannot read {folder}/config.json: {exc}") from None
        model_type, entry = code
        native = NATIVE_CHECKPOINTS.get(model_type)
        raise ModelSpecError(
            f"{Path(folder) / 'config.json'}: written for the model's own code (`auto_map` maps `AutoConfig` to "
            f"`{entry}`), a layout transformers' own `{model_type}` does not read ({str(exc).splitlines()[0][:200]}); "
            "Streamwise never runs a folder's code: use the checkpoint converted to transformers' native layout"
            + (f" ({native})" if native else "")) from None


#: Where the checkpoints of a family first published with code of their own are, converted to transformers' layout.
NATIVE_CHECKPOINTS = {
    "florence2": "florence-community/Florence-2-base and -large, and their -ft fine-tunes",
}


def _remote_config(folder: str | os.PathLike) -> tuple[str, str] | None:
    """(model_type, the code `auto_map` names for `AutoConfig`) where config.json maps it to the folder's code."""
    import json

    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        entry = _first(config["auto_map"]["AutoConfig"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None
    return (str(config.get("model_type")), str(entry)) if entry else None


def refuse_remote_code(folder: str | os.PathLike, name: str, entry: str) -> None:
    """Refuse a folder whose `name` (config.json, tokenizer_config.json) maps `entry` to Python code of its own
    (`auto_map`) for a class transformers does not ship: Streamwise never runs a model folder's code, and asks
    nobody whether to (transformers would prompt on stdin, which blocks a server), so this says what needs it."""
    import json

    import transformers

    try:
        config = json.loads((Path(folder) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return  # transformers reports an unreadable file itself
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict) or entry not in auto_map:
        return
    model_type = config.get("model_type")
    if entry == "AutoConfig" and model_type in transformers.CONFIG_MAPPING:
        return  # transformers ships the class: the folder's code is never needed
    if entry == "AutoTokenizer" and not _custom_tokenizer(transformers, config):
        return
    raise ModelSpecError(
        f"{Path(folder) / name}: `auto_map` maps `{entry}` to `{_first(auto_map[entry])}`, Python code in the folder "
        f"itself" + (f" (model_type `{model_type}` is not one transformers ships)" if entry == "AutoConfig" else "")
        + "; Streamwise never runs a model folder's code (trust_remote_code=False): use a transformers release that "
        "ships the class, or build the model yourself and pass it to streamwise.load"
    )


def _custom_tokenizer(transformers, config: dict) -> bool:
    """Whether a tokenizer config names a class transformers does not have (so only the folder's code has it)."""
    name = config.get("tokenizer_class")
    return not (isinstance(name, str) and (hasattr(transformers, name) or hasattr(transformers, f"{name}Fast")))


def _first(value: object) -> object:
    return value[0] if isinstance(value, list) and value else value


class Built(NamedTuple):
    """A model built from a config, and which class it is and why that one, in words for the load report."""

    model: nn.Module
    how: str
    """E.g. `WhisperForConditionalGeneration (config.architectures)`."""


# transformers' task mappings, tried in this order where `config.architectures` names no class transformers builds
# from the config (a config made by `AutoConfig.for_model`, a llama.cpp GGUF's): the tasks that generate first, since a
# streamed model is most often run to generate, the causal LM first of them (the class this default always was:
# Whisper's decoder alone, `WhisperForCausalLM`), then image/audio-text-to-text, seq2seq, speech-to-text and
# text-to-speech; the bare base model last.
TASKS = (
    ("causal LM", "MODEL_FOR_CAUSAL_LM_MAPPING"),
    ("image/audio-text-to-text", "MODEL_FOR_MULTIMODAL_LM_MAPPING"),
    ("seq2seq LM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING"),
    ("speech seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING"),
    ("text-to-waveform", "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING"),
    ("base model", "MODEL_MAPPING"),
)


def auto_model(config, dtype: torch.dtype | None = None, model_class: type | str | None = None) -> Built:
    """The model of a transformers config, built in `dtype` (default: the config's `dtype`) for this thread only
    (`build_dtype`): `model_class` (a transformers class or its name) where given, else the first class of
    `config.architectures` that transformers has for this config, else the first of `TASKS` that maps it.

    The config's dtype is checked first, since transformers reports one it cannot build in as an error of the model's
    own; and transformers would switch the process's default dtype to build in one, so it is handed none and the dtype
    is recorded on the config afterwards, as it records it."""
    stored = getattr(config, "dtype", None)
    stored = getattr(torch, stored, stored) if isinstance(stored, str) else stored
    if stored is not None and stored not in BUILD_DTYPES:
        choices = ", ".join(str(d).removeprefix("torch.") for d in BUILD_DTYPES)
        raise ModelSpecError(
            f"the config's `dtype` {str(stored).removeprefix('torch.')} is not a floating dtype a model can be built "
            f"in; set `dtype` (or `torch_dtype`) in config.json to one of {choices}"
        )
    dtype = dtype or stored
    cls, why = _asked(model_class) if model_class is not None else _named_or_mapped(config)
    try:
        with building_in(dtype):
            model = cls._from_config(_config_for(cls, config) or config, dtype=None)
    except Exception as exc:  # the model's own code refusing the config, with any exception type
        raise ModelSpecError(f"transformers cannot build `{cls.__name__}` from this {type(config).__name__}: "
                             f"{type(exc).__name__}: {exc}") from None
    for built in (model.config, *(getattr(model.config, key) for key in model.config.sub_configs)):
        if built is not None:
            built.dtype = dtype
    return Built(model, f"{cls.__name__} ({why})")


def _asked(model_class: type | str) -> tuple[type, str]:
    import transformers

    if isinstance(model_class, str):
        cls = _model_class(transformers, model_class)
        if cls is None:
            guess = did_you_mean(model_class, _model_class_names(transformers))
            raise ModelSpecError(f"transformers has no model class `{model_class}`"
                                 + (f"; did you mean `{guess}`?" if guess else ""))
        return cls, "asked for"
    if not _is_model_class(transformers, model_class):
        raise ModelSpecError(f"`model_class` must be a transformers model class or its name, not {model_class!r}")
    return model_class, "asked for"


def _named_or_mapped(config) -> tuple[type, str]:
    """The class `config.architectures` names, else the first task mapping's, with why."""
    import transformers
    from transformers.models.auto import modeling_auto

    named = list(getattr(config, "architectures", None) or ())
    for name in named:
        cls = _model_class(transformers, name)
        if cls is not None and _config_for(cls, config) is not None:
            return cls, "config.architectures"
    unusable = f"; config.architectures {named} names no transformers class for it" if named else ""
    for task, mapping in TASKS:
        mapping = getattr(modeling_auto, mapping)
        if type(config) in mapping:
            found = mapping[type(config)]
            return (found[0] if isinstance(found, tuple) else found), f"task mapping: {task}{unusable}"
    raise ModelSpecError(f"no transformers class builds model_type `{config.model_type}`")


def _model_class(transformers, name: str) -> type | None:
    """The transformers model class of that name, else None."""
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    return cls if _is_model_class(transformers, cls) else None


def _is_model_class(transformers, cls: object) -> bool:
    """A transformers model class that builds from a config (its base classes have no config class)."""
    return isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) and cls.config_class is not None


def _config_for(cls: type, config):
    """The config `cls` builds from: `config`, or its text part for a text-only class (as transformers' auto classes
    pick it); None when it is neither."""
    if isinstance(config, cls.config_class):
        return config
    if cls.config_class is config.sub_configs.get("text_config"):
        return config.get_text_config()
    return None


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
        return auto_model(transformers.AutoConfig.for_model(name, **overrides)).model
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
