"""A checkpoint seen under the keys of the transformers model it loads into, as `from_pretrained` sees it.

transformers 5 keeps checkpoints in their published layout and converts them on load: it renames keys (LLaVA's
`language_model.model.*` to `model.language_model.*`), stacks per-expert weights into one tensor (Mixtral's
`experts.0.w1.weight`, ... into `experts.gate_up_proj`), and adds or strips the base model's prefix (`model.`) when a
task model loads a base model's file or the other way round. `save_pretrained` writes that layout back, so a folder it
wrote loads only through the same conversion. The conversion here is transformers' own: its tables for the model
(`get_model_conversion_mapping`) applied by its key renaming and its operations, so nothing is a table of ours. A
renamed tensor stays a view of the file; a converted one is computed here, as transformers computes it. Keys no rule
maps keep their names, so the loader's checks (missing, extra, shape, dtype) still see every tensor.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import replace

from torch import nn

from .readers import CheckpointError
from .stored import Checkpoint, StoredTensor


def under_model_keys(checkpoint: Checkpoint, model: nn.Module) -> Checkpoint:
    """`checkpoint` with transformers' load-time conversion for `model` applied; `checkpoint` itself where the model is
    no transformers model, the file is not safetensors, or its keys are all the model's already."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return checkpoint
    if not isinstance(model, PreTrainedModel) or checkpoint.kind != "safetensors":
        return checkpoint
    expected = model.state_dict(keep_vars=True)
    if set(checkpoint.tensors) <= set(expected):
        return checkpoint
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = model.base_model_prefix
    tensors: dict[str, StoredTensor] = {}
    sources: dict[str, str] = {}  # model key -> the file tensor it came from, to name a collision
    groups: dict[str, tuple[WeightConverter, str]] = {}
    problems = []
    for name in sorted(checkpoint.tensors, key=dot_natural_key):  # experts in order: 0, 1, ..., 10
        stored = checkpoint.tensors[name]
        key, pattern = rename_source_key(name, renamings, converters, prefix, expected)
        if key not in expected and name in expected:  # as transformers: the name was right, at most the prefix moves
            key, pattern = rename_source_key(name, [], [], prefix, expected)
        if key in expected and pattern is not None:
            converter, _ = groups.setdefault(key, (deepcopy(by_pattern[pattern]), stored.file))
            converter.add_tensor(key, name, pattern, stored.read)
            continue
        key = key if key in expected else name  # unmapped: the loader names it as an extra tensor
        if key in sources:
            problems.append(f"{stored.file}: tensors `{sources[key]}` and `{name}` both load into `{key}` "
                            f"of {type(model).__name__}")
        sources[key] = name
        tensors[key] = stored if key == name else replace(stored, name=key)
    for key, (converter, file) in groups.items():
        try:
            converted = converter.convert(key, model=model, config=model.config)
        except Exception as exc:  # an operation refusing what the file holds (a missing expert, a shape)
            problems.append(f"{file}: transformers' conversion to `{key}` failed: {type(exc).__name__}: {exc}")
            continue
        for target, tensor in converted.items():
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            tensors[target] = StoredTensor(target, file, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t)
    if problems:
        raise CheckpointError(problems)
    return replace(checkpoint, tensors=tensors)
