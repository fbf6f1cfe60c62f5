"""Boot a real ComfyUI core checkout (COMFYUI_ROOT) on CPU inside the test process.

ComfyUI core is not on PyPI, so these tests run only where a checkout is given. torchvision and
torchaudio are stubbed: installing them beside a CPU torch would replace torch. One core per
process: cores share top-level module names (`comfy`, `nodes`, `folder_paths`).
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import types
from pathlib import Path

STUBBED = ("torchvision", "torchaudio")
ROOT_ENV = "COMFYUI_ROOT"


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision/torchaudio are stubbed in the ComfyUI test harness")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Unavailable,), {"__module__": self.__name__})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module):
        pass


class Uninstalled(importlib.abc.MetaPathFinder):
    """Hides installed top-level packages, as a ComfyUI user who only cloned the pack into custom_nodes has none."""

    def __init__(self, *names: str):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


class _Recorded:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _RecordedType:
    Input = Output = _Recorded


def stand_in_comfy_api() -> types.ModuleType:
    """A `comfy_api.latest` whose schema and output types keep what they are given (`.args`, `.kwargs`): enough to
    define and run the nodes where no core is checked out."""
    latest = types.ModuleType("comfy_api.latest")
    latest.__spec__ = importlib.machinery.ModuleSpec(latest.__name__, None)
    latest.ComfyExtension = type("ComfyExtension", (), {})
    latest.io = types.SimpleNamespace(ComfyNode=object, Schema=_Recorded, NodeOutput=_Recorded, Input=_Recorded,
                                      ComfyTypeIO=_RecordedType, Model=_RecordedType, Combo=_RecordedType,
                                      String=_RecordedType, Int=_RecordedType, Float=_RecordedType,
                                      Boolean=_RecordedType)
    latest.ui = types.SimpleNamespace(PreviewText=_Recorded)
    return latest


def comfyui_root() -> Path | None:
    root = os.environ.get(ROOT_ENV)
    return Path(root).resolve() if root else None


def boot(root: Path, user_dir: Path):
    """Import ComfyUI core on CPU and return its `nodes` module."""
    booted = getattr(sys.modules.get("folder_paths"), "__file__", None)
    if booted is not None:
        if Path(booted).resolve().parent != root:
            raise RuntimeError(f"another ComfyUI core is already loaded from {booted}")
        return sys.modules["nodes"]
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, str(root))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management reads it
    import comfy.model_management
    import folder_paths
    import nodes

    folder_paths.set_user_directory(str(user_dir))
    return nodes


def load_custom_node(nodes, path: Path) -> bool:
    """ComfyUI's own loader (async in current cores)."""
    result = nodes.load_custom_node(str(path))
    return asyncio.run(result) if inspect.isawaitable(result) else result


def generate_text(mappings: dict, model, prompt: str, tokens: int, *, seed: int = 0, sampling: str = "greedy",
                  **inputs):
    """Streamwise Generate Text (from core's `NODE_CLASS_MAPPINGS`) run as a workflow runs it, its inputs by name:
    chat off (the prompt continued as it is) and greedy, unless `inputs` say otherwise."""
    given = dict(system="", chat=False, temperature=0.7, top_p=0.9, top_k=50)
    given.update(inputs)
    return mappings["StreamwiseGenerateText"].execute(model, prompt=prompt, max_new_tokens=tokens, seed=seed,
                                                      sampling=sampling, **given)
