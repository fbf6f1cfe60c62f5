"""Which file of a model folder holds its weights, by the names transformers and diffusers write.

`save_pretrained` writes `model.safetensors` (transformers) or `diffusion_pytorch_model.safetensors` (diffusers);
split weights get a shard index, `<stem>.safetensors.index.json`, beside the shards; `variant="fp16"` puts the
variant before the suffix (`model.fp16.safetensors`, `diffusion_pytorch_model.safetensors.index.fp16.json`). A
folder's weights are its shard index, or variants of one weights file (each a shard index or a single file; any
other `.safetensors` beside an index are its shards); else its one `.safetensors` file, else its one `.gguf`. Among
variants, the one named for the dtype asked for wins, else the plain one, else the only one; a choice still open is
refused (load the file by name, or pass the dtype).

Names only: no file is opened and torch is not imported, so the ComfyUI model picker lists folders by this rule.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ...errors import Error

SHARD_INDEX = "model.safetensors.index.json"
_INDEX = re.compile(r"(?P<stem>model|diffusion_pytorch_model)\.safetensors\.index(?:\.(?P<variant>\w+))?\.json")
_SINGLE = re.compile(r"(?P<stem>model|diffusion_pytorch_model)(?:\.(?P<variant>\w+))?\.safetensors")
#: The variant `save_pretrained` names for a dtype (keys as `str(dtype)` without `torch.`).
VARIANTS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


class NoWeights(Error, ValueError):
    """The folder's file names name no weights, or more than one set without a way to choose."""


def is_shard_index(name: str) -> bool:
    """A shard index by its name: `*.index.json`, or a variant's `<stem>.safetensors.index.<variant>.json`."""
    return name.endswith(".index.json") or _INDEX.fullmatch(name) is not None


def weights_file(names: Collection[str], variant: str | None = None) -> str:
    """The one of `names` (a folder's entries) holding the folder's weights, preferring `variant` among variants."""
    safetensors = [name for name in names if name.endswith(".safetensors")]
    singles, indexes = _variants(safetensors, _SINGLE), _variants(names, _INDEX)
    if indexes or (len(safetensors) > 1 and sum(map(len, singles.values())) == len(safetensors)):
        # each variant's index, else its single file (the shards beside an index are neither)
        return _preferred({stem: {**singles.get(stem, {}), **indexes.get(stem, {})} for stem in {*singles, *indexes}},
                          variant)
    ggufs = [name for name in names if name.endswith(".gguf")]
    if len(safetensors) == 1 or (not safetensors and len(ggufs) == 1):
        return (safetensors or ggufs)[0]
    raise NoWeights(f"expected `{SHARD_INDEX}` (or diffusers' `diffusion_pytorch_model.safetensors.index.json`), "
                    "or one .safetensors or .gguf file, in the folder")


def _variants(names: Collection[str], pattern: re.Pattern) -> dict[str, dict[str | None, str]]:
    """`{stem: {variant or None: name}}` of the names `pattern` matches."""
    found: dict[str, dict[str | None, str]] = {}
    for name in sorted(names):
        if match := pattern.fullmatch(name):
            found.setdefault(match["stem"], {})[match["variant"]] = name
    return found


def _preferred(found: dict[str, dict[str | None, str]], variant: str | None) -> str:
    if len(found) > 1:
        raise NoWeights(f"holds both {' and '.join(f'`{stem}` weights' for stem in sorted(found))}; load one by name")
    (stem, variants), = found.items()
    for key in (variant, None):
        if key in variants:
            return variants[key]
    if len(variants) == 1:
        return next(iter(variants.values()))
    named = ", ".join(sorted(v for v in variants if v is not None))
    raise NoWeights(f"holds the variants {named} of its `{stem}` weights and no plain file: pass the dtype of one "
                    f"({', '.join(f'{v}: {d}' for d, v in VARIANTS.items() if v in variants)}) or load one by name")
