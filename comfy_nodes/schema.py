"""The pack's node schemas: core's `io.Schema` with what every node of the pack shares, feature-detected.

Categories sit under `streamwise/`, named as core names its own (`loaders`, `model_patches`, `text`, `audio`,
`utils`). Search aliases are the words users type for such a node (`gguf`, `llm`, `vibevoice`, `tts`, `offload`,
`lowvram`, `compile`, `quantize`) and `streamwise` on every node; cores whose schema has no `search_aliases` (before
v0.33) get none, and their frontend searches the node id and display name only.
"""

from __future__ import annotations

import inspect

from comfy_api.latest import io

_FIELDS = inspect.signature(io.Schema).parameters


def schema(*, category: str, aliases: tuple[str, ...], reports: bool = False, **fields) -> io.Schema:
    """`io.Schema(**fields)` in `streamwise/<category>`, found by `aliases` and `streamwise` where the core can.

    `reports`: the node shows a report but is no output node (the loader, apply and compile nodes); cores that know
    intermediate outputs (v0.33) send it again when the node is cached, so a reopened page still shows it.
    """
    extra: dict[str, object] = {}
    if "search_aliases" in _FIELDS:
        extra["search_aliases"] = ["streamwise", *aliases]
    if reports and "has_intermediate_output" in _FIELDS:
        extra["has_intermediate_output"] = True
    return io.Schema(category=f"streamwise/{category}", **extra, **fields)
