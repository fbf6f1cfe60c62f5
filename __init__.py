"""Streamwise: declarative TOML policies that make any PyTorch module tree stream, quantize and
compile under low VRAM.

This folder is imported two ways: by pip users as the package `streamwise`, and by ComfyUI as a
custom-node pack (under the folder's own name). Importing it is light (no torch, no ComfyUI);
the ComfyUI nodes are registered only when ComfyUI itself is running. A bare import of this file
outside any package (pytest collecting a checkout whose folder name is no identifier, such as
`ComfyUI-Streamwise`) finds nothing to import from and exports nothing.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__: list[str] = []

# The engine needs torch; it is imported on first use so that `import streamwise` (and the
# policy validator) stays fast.
_ENGINE = {
    "resolve": ".runtime.plan",
    "apply": ".runtime.engine",
    "apply_policy": ".runtime.engine",
    "revert": ".runtime.engine",
    "offload": ".runtime.hosts.standalone",
    "model_patcher": ".runtime.hosts.comfyui",
    "load": ".runtime.checkpoint",
    "skeleton": ".runtime.checkpoint",
    "load_pretrained": ".runtime.checkpoint",
    "lazy_compile": ".runtime.compile",
    "compile_stats": ".runtime.compile",
}


def _running_in_comfyui() -> bool:
    try:
        return importlib.util.find_spec("folder_paths") is not None and importlib.util.find_spec("comfy") is not None
    except (ImportError, ValueError):
        return False


if __package__:
    from .runtime import PolicyError, load_policy
    from .schemas import Policy

    __all__ = ["Policy", "PolicyError", "load_policy", *_ENGINE]

    def __getattr__(name: str):
        if name in _ENGINE:
            return getattr(importlib.import_module(_ENGINE[name], __name__), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    if _running_in_comfyui():
        # One engine per process: where `streamwise` is also installed (other packs `import streamwise`),
        # the nodes come from that installation, so MODELs made either way share their classes.
        if __package__ != "streamwise" and importlib.util.find_spec("streamwise") is not None:
            from streamwise.comfy_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
        else:
            from .comfy_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

        __all__ += ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
