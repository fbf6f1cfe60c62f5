"""Streamwise: declarative TOML policies that make any PyTorch module tree stream, quantize and
compile under low VRAM.

This folder is imported two ways: by pip users as the package `streamwise`, and by ComfyUI as a
custom-node pack (under the folder's own path). Importing it is light (no torch, no ComfyUI);
the ComfyUI nodes (V3 schema, through `comfy_entrypoint`) are exposed only when ComfyUI itself is
running. A bare import of this file outside any package (pytest collecting a checkout whose folder
name is no identifier, such as `ComfyUI-Streamwise`) finds nothing to import from and exports nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

__all__: list[str] = []

# The engine needs torch; it is imported on first use so that `import streamwise` (and the
# policy validator) stays fast.
_ENGINE = {
    "resolve": ".runtime.plan",
    "apply": ".runtime.convert",
    "apply_policy": ".runtime.convert",
    "revert": ".runtime.convert",
    "offload": ".runtime.hosts.standalone",
    "dispatch": ".runtime.hosts.dispatch",
    "model_patcher": ".runtime.hosts.comfyui",
    "load": ".runtime.checkpoint",
    "skeleton": ".runtime.builders",
    "register_builder": ".runtime.builders",
    "load_pretrained": ".runtime.checkpoint",
    "lazy_compile": ".runtime.compile",
    "compile_stats": ".runtime.compile",
    "draft_policy": ".runtime.plan.draft",
}


def _running_in_comfyui() -> bool:
    try:
        return importlib.util.find_spec("folder_paths") is not None and importlib.util.find_spec("comfy") is not None
    except (ImportError, ValueError):
        return False


def _streamwise_nodes():
    """`streamwise.comfy_nodes`: from the installed `streamwise` where there is one, else from this folder imported
    under that name."""
    try:
        return importlib.import_module("streamwise.comfy_nodes")
    except ModuleNotFoundError as missing:
        if missing.name != "streamwise":
            raise
    spec = importlib.util.spec_from_file_location(
        "streamwise", __file__, submodule_search_locations=[os.path.dirname(os.path.abspath(__file__))])
    module = sys.modules["streamwise"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["streamwise"]
        raise
    return importlib.import_module("streamwise.comfy_nodes")


if __package__ and __package__ != "streamwise" and _running_in_comfyui():
    # ComfyUI imports a pack under its folder's path, so every module below it, and the type of every error a node
    # raises (`/…/custom_nodes/ComfyUI-Streamwise.runtime.policy.diagnostics.PolicyError`), would be named by
    # that path. The nodes come from the package `streamwise` instead: one engine per process, shared with other
    # packs that `import streamwise`, and errors that read `streamwise.…`.
    comfy_entrypoint = _streamwise_nodes().comfy_entrypoint
    __all__ = ["comfy_entrypoint"]
elif __package__:
    from .errors import Error
    from .runtime import PolicyError, load_policy
    from .schemas import Policy

    __all__ = ["Error", "Policy", "PolicyError", "load_policy", *_ENGINE]

    def __getattr__(name: str):
        if name in _ENGINE:
            return getattr(importlib.import_module(_ENGINE[name], __name__), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        """The public names (the engine's are imported only on first use) and the subpackages; no import helpers."""
        return sorted({*__all__, "runtime", "schemas"})

    if _running_in_comfyui():
        from .comfy_nodes import comfy_entrypoint

        __all__ += ["comfy_entrypoint"]

if __package__ and _running_in_comfyui():
    WEB_DIRECTORY = "./web"  # the frontend extension that shows results on the pack's nodes (web/streamwise.js)
    __all__ += ["WEB_DIRECTORY"]
