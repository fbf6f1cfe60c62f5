"""`load_pretrained(path, policy)`: a model folder or weight file in, a loaded, converted tree out.

The steps a user would otherwise wire by hand, in the order that keeps memory flat: build the skeleton from the
config beside the weights (`skeleton`: transformers' or diffusers'), or, for a GGUF with no config.json beside it,
from the GGUF's own metadata (the files a Streamwise GGUF carries, `carried_files`; a llama.cpp file's description,
`llama_cpp.gguf_config`), pick the policy by name or by its `[match]` table
(`plan.auto`), and fill the skeleton from the file (`fill`). A model that generates gets the checkpoint's own
generation settings (`generation_defaults`), as transformers' `from_pretrained` gives them.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ...schemas import Policy
from ..builders.build_dtype import BUILD_DTYPES
from ..builders.model_spec import ModelSpecError, auto_model, refuse_remote_code
from ..builders.skeleton import built_skeleton, config_folder, model_type, skeleton
from ..convert import applied_state
from ..plan.auto import choose_policy
from . import carried_files, generation_defaults
from .fill import LoadReport, load
from .readers import CheckpointError, open_checkpoint
from .stored import Checkpoint

_log = logging.getLogger("streamwise.load")


class Pretrained(NamedTuple):
    model: nn.Module
    report: LoadReport
    policy: str
    """Which policy converted the tree and how it was chosen, in words."""


def load_pretrained(
    path: str | os.PathLike,
    policy: Policy | str | os.PathLike = "auto",
    *,
    dtype: torch.dtype | None = None,
    model_class: type | str | None = None,
    policy_dirs: Iterable[str | os.PathLike] = (),
    progress: Callable[[int, int], None] | bool | None = None,
    allow_stranded: bool = True,
    max_memory: object = None,
    file_tier: bool = True,
    skip_unreadable: bool = False,
    component: str | None = None,
    arithmetic: str = "int8",
) -> Pretrained:
    """Build, convert and load the model at `path` (a Hugging Face or diffusers model folder, a weight file beside its
    config.json, or a `.gguf` alone: llama.cpp's layout, the model described by its metadata).

    The class built is `model_class` (a transformers or diffusers class, or its name) where given, else the one the
    config names (`config.architectures`, diffusers' `_class_name`), else what transformers' task mappings give
    (`model_spec.auto_model`); `report.built` says which and why. `policy="auto"` picks the policy whose `[match]`
    recognizes the model, and refuses to guess between equal matches. Without `dtype` the model takes the floating
    dtype most of the file's values are stored in (float8 counts as bfloat16); a folder holding several variants of
    its weights loads the one named for `dtype` (`model.fp16.safetensors`), else the plain one. The tree's recorded
    `source` (where its tokenizer comes from, `load_tokenizer`) is the config's folder, or the `.gguf` built from
    alone. `progress`, `allow_stranded`, `max_memory` (the host budget), `file_tier` and `arithmetic` (how GGUF weights
    compute on the CPU) are as for `load`; the class
    built and the choice of policy are logged (logger `streamwise.load`), then the load's report. A diffusers
    pipeline folder (`model_index.json`) loads its `component` (`"unet"`, `"transformer"`, `"vae"`...); without one,
    the error lists them. `skip_unreadable` as for `choose_policy`.
    """
    path = pipeline_component(Path(path), component)
    checkpoint = open_checkpoint(path, dtype)  # first: an unusable path is a CheckpointError, before any other look
    folder = config_folder(path)
    dtype = dtype or _file_dtype(checkpoint)
    if checkpoint.kind == "gguf" and not (folder / "config.json").is_file():
        try:
            if checkpoint.architecture == carried_files.ARCHITECTURE:
                with carried_files.unpacked(_carried_model(checkpoint)) as carried:
                    model, built = built_skeleton(carried, dtype, model_class)
                    kind = model_type(carried)
                    settings = _generation_settings(model, lambda: generation_defaults.from_folder(carried))
            else:
                from .llama_cpp import gguf_config, with_rope_factors  # GGUF only, as `gguf_reader` (open_checkpoint)

                config = gguf_config(checkpoint.path)  # a CheckpointError naming an architecture it cannot map
                with skeleton():
                    model, built = auto_model(config, dtype, model_class)
                with_rope_factors(model, checkpoint)
                model.eval()
                kind = config.model_type
                settings = _generation_settings(model, lambda: _llama_cpp_settings(checkpoint, config))
        except ModelSpecError as exc:  # the model the file's own metadata describes cannot be built: the file's fault
            raise CheckpointError([f"{checkpoint.path}: {exc}"]) from None
        source = checkpoint.path
    else:
        model, built = built_skeleton(folder, dtype, model_class)
        source, kind = str(folder), model_type(folder)
        settings = _generation_settings(model, lambda: generation_defaults.from_folder(folder))
    choice = choose_policy(policy, model, model_type=kind, dirs=policy_dirs, skip_unreadable=skip_unreadable)
    policy, chosen = choice.policy, choice.reason
    _log.info("load_pretrained: %s: built %s; %s", path.name, built, chosen)
    report = load(model, checkpoint.path, policy, dtype=dtype, progress=progress, allow_stranded=allow_stranded,
                  max_memory=max_memory, file_tier=file_tier, arithmetic=arithmetic)
    report = replace(report, built=built)
    applied_state(model).source = source
    if settings is not None:  # the checkpoint's own, where the model generates
        model.generation_config = settings
    return Pretrained(model, report, chosen)


def _generation_settings(model: nn.Module, read: Callable[[], object]):
    """The checkpoint's generation settings (`read()`, before anything is loaded: a broken file is said first) for a
    model that generates, as transformers' `from_pretrained` gives them to one; None for any other model."""
    can_generate = getattr(model, "can_generate", None)
    return read() if callable(can_generate) and can_generate() else None


def pipeline_component(path: Path, component: str | None) -> Path:
    """`path`, or its `component`'s folder where `path` is a diffusers pipeline folder (`model_index.json`, no
    config.json of its own); a CheckpointError listing the components where none, or one it does not have, is named."""
    index = path / "model_index.json"
    if not (path.is_dir() and index.is_file() and not (path / "config.json").exists()):
        if component is not None:
            raise CheckpointError([f"{path}: component={component!r} names a part of a diffusers pipeline folder "
                                   f"(one with model_index.json), and this is not one"])
        return path
    try:
        described = json.loads(index.read_text(encoding="utf-8")) if index.stat().st_size < 1 << 20 else {}
    except (OSError, ValueError):
        described = {}
    parts = {name: value[1] for name, value in described.items() if isinstance(value, list) and len(value) == 2
             and isinstance(value[1], str) and (path / name / "config.json").is_file()}
    listed = ", ".join(f"{name} ({cls})" for name, cls in sorted(parts.items())) or "none with a config.json"
    if component in parts:
        return path / component
    asked = "" if component is None else f"has no component {component!r} with a config.json; "
    raise CheckpointError([f"{path}: a diffusers pipeline folder (model_index.json) {asked}load one of its "
                           f"components with component=NAME (the ComfyUI loader lists each as `folder/NAME`): "
                           f"{listed}"])


def _llama_cpp_settings(checkpoint: Checkpoint, config):
    """A llama.cpp file's generation settings: the folder's own where Streamwise carried them, else its metadata's."""
    from .llama_cpp import gguf_metadata

    if "generation_config.json" in carried_files.listed(checkpoint.metadata):
        files = carried_files.carried(checkpoint.metadata, checkpoint.path)
        with carried_files.unpacked({"generation_config.json": files["generation_config.json"]}) as carried:
            return generation_defaults.from_folder(carried)
    return generation_defaults.from_llama_cpp(config, checkpoint.metadata,
                                              gguf_metadata(checkpoint.path)["tokenizer"].get("tokens"))


def _carried_model(checkpoint: Checkpoint) -> dict[str, bytes]:
    """The model's files a Streamwise GGUF carries; a CheckpointError saying what to do where they hold no
    config.json."""
    files = carried_files.carried(checkpoint.metadata, checkpoint.path)
    if "config.json" not in files:
        raise CheckpointError([
            f"{checkpoint.path}: a GGUF Streamwise wrote without its model's config.json (an older version of "
            "`streamwise quantize`, or a source folder without one), so nothing describes the model to build: put "
            "the model's config.json (and tokenizer files) beside it, or write it again from the model's folder: "
            f"`streamwise quantize MODEL_FOLDER {checkpoint.path}`"])
    return files


def load_tokenizer(source: str | os.PathLike):
    """The tokenizer of a tree's recorded `source`: a model folder's own files; for a `.gguf`, the tokenizer files it
    carries (a GGUF Streamwise wrote, in either layout: the folder's own), else the one in its llama.cpp metadata
    (transformers rebuilds it: `AutoTokenizer.from_pretrained(folder, gguf_file=...)`). Read once per version of its
    files (`model_identity`): rebuilding a 150k-token vocabulary from GGUF metadata takes about 20 s, and a host
    tokenizes once per prompt."""
    from .discover import model_identity  # its GGUF header reader imports gguf, which a safetensors load never needs

    source = Path(source)
    return _tokenizer(str(source), model_identity(source))


@functools.lru_cache(maxsize=4)
def _tokenizer(source: str, identity: tuple):
    import transformers

    source = Path(source)
    if source.suffix == ".gguf" and not source.is_dir():
        checkpoint = open_checkpoint(source)
        carried_tokenizer = set(carried_files.listed(checkpoint.metadata)) & set(carried_files.TOKENIZER)
        if checkpoint.architecture == carried_files.ARCHITECTURE or carried_tokenizer:  # the model's own files
            with carried_files.unpacked(carried_files.carried(checkpoint.metadata, checkpoint.path)) as carried:
                return _folder_tokenizer(carried)
        if not any(key.startswith("tokenizer.ggml.") for key in checkpoint.metadata):
            raise CheckpointError([f"{source}: the file carries no tokenizer (no `tokenizer.ggml.*` metadata); load "
                                   "it from the model's own folder instead (`load_tokenizer(folder)`, the folder "
                                   "holding its tokenizer.json or tokenizer.model)"])
        try:
            with checkpoint.header_copy() as copy:  # the checked header, never the file itself
                tokenizer = transformers.AutoTokenizer.from_pretrained(
                    os.path.dirname(copy), gguf_file=os.path.basename(copy), local_files_only=True,
                    trust_remote_code=False)
            from .llama_cpp import as_llama_cpp_tokenizes  # GGUF only, as `gguf_reader` (open_checkpoint)

            return as_llama_cpp_tokenizes(tokenizer, checkpoint)
        except CheckpointError:
            raise
        except Exception as exc:  # transformers' GGUF tokenizer conversion signals with many exception types
            model = checkpoint.metadata.get("tokenizer.ggml.model")
            raise CheckpointError([f"{source}: transformers builds no tokenizer from this GGUF's "
                                   f"`{model.value if model else '?'}` vocabulary of architecture "
                                   f"`{checkpoint.architecture}` ({type(exc).__name__}: {exc}); load it from the "
                                   "model's own folder instead (`load_tokenizer(folder)`)"]) from None
    return _folder_tokenizer(source)


#: Files a transformers tokenizer is built from; a folder with none of them has no tokenizer to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt", "sentencepiece.bpe.model", "tekken.json")


def _folder_tokenizer(folder: Path):
    import transformers

    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES) \
            and not any(folder.glob("*.tiktoken")):
        raise CheckpointError([f"{folder} holds no tokenizer files (any of {', '.join(TOKENIZER_FILES)}, *.tiktoken): "
                               "copy the model's tokenizer files beside its weights"])
    refuse_remote_code(folder, "tokenizer_config.json", "AutoTokenizer")
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def _file_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The floating dtype most stored values have (float32 norms beside bf16 weights do not decide);
    float8 values count as bfloat16, the dtype they compute in."""
    counts: dict[torch.dtype, int] = {}
    for stored in checkpoint.tensors.values():
        if stored.dtype.is_floating_point:
            dtype = stored.dtype if stored.dtype in BUILD_DTYPES else torch.bfloat16
            counts[dtype] = counts.get(dtype, 0) + math.prod(stored.shape)
    return max(counts, key=counts.get) if counts else torch.float32
