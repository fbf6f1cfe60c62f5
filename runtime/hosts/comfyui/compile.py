"""The MODEL half of lazy compile: a ComfyUI MODEL is armed through object patches.

Invariants:
- the compile stage learns of MODELs only through the target this module registers (`HOST_TARGETS["comfyui"]`),
  on import: importing the ComfyUI host (`hosts.comfyui`) registers it;
- core sets object patches while the MODEL is loaded and undoes them on unload; the compile node arms a MODEL over
  a copy of its input's tree (`patcher.copied`), so even a loaded compiled MODEL leaves its input's tree alone;
- guards on core's per-call dictionaries are dropped (their contents change every call);
- when compiling stops during a prompt, the user is told where ComfyUI shows a node's news: as text on the node
  that is executing (core's `send_progress_text`, which the frontend draws on that node) and in the log, which
  the frontend's log panel shows;
- a dynamic-VRAM MODEL is demoted only when asked, when core can, and never once Streamwise converted it
  (core demotes by rebuilding the model from its file, without the conversion).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from torch import nn

from ....schemas import CompileSettings
from ...compile.arm import compile_stats, lazy_compile
from ...compile.regions import Region, is_region_forward, log
from ...compile.targets import HOST_TARGETS, Armed, Target
from ...convert import applied_state
from ...plan.selectors import joined

#: Per-call dictionaries whose contents change every call: guarding on them only forces recompiles.
PER_CALL_DICTS = ("transformer_options", "model_options", "patches_replace")
DYNAMIC_VRAM_MESSAGE = (
    "Dynamic VRAM remains enabled for this MODEL; ComfyUI currently treats this combination as experimental "
    "because VBAR operations cause graph breaks."
)


def is_model_patcher(value: Any) -> bool:
    return isinstance(getattr(value, "model", None), nn.Module) and hasattr(value, "load_device")


class _PatcherTarget(Target):
    per_call_names = PER_CALL_DICTS

    def __init__(self, patcher: Any) -> None:
        super().__init__(patcher, patcher.model)

    def prepared(self, settings: CompileSettings) -> Target:
        demoted = _handle_dynamic_vram(self.holder, settings)
        return self if demoted is self.holder else _PatcherTarget(demoted)

    def install(self, path: str, unit: nn.Module, forward: Any, own: Any, armed: Armed) -> None:
        self.holder.add_object_patch(joined(path, "forward"), forward)

    def remove(self, armed: Armed) -> None:
        patches = self.holder.object_patches
        for key in [k for k, v in patches.items() if is_region_forward(v)]:
            del patches[key]

    @staticmethod
    def notify(message: str) -> None:
        log.warning(message)
        try:
            from comfy_execution.utils import get_executing_context
            from server import PromptServer
        except ImportError:  # a core without either: the log and the warning stay
            return
        context, server = get_executing_context(), getattr(PromptServer, "instance", None)
        if context is not None and server is not None:
            server.send_progress_text(message, context.node_id, server.client_id)

    def regions(self) -> list[Region]:
        return [value.func for value in self.holder.object_patches.values() if is_region_forward(value)]


@HOST_TARGETS.decorator("comfyui")
def model_patcher_target(value: Any) -> Target | None:
    """The target for a ComfyUI MODEL; None for anything else."""
    return _PatcherTarget(value) if is_model_patcher(value) else None


def armed_with_report(patcher: Any, **options) -> tuple[Any, str]:
    """`lazy_compile(patcher, **options)` and what the compile node shows of it: what was armed (or why nothing
    was) and each warning arming gave, which is also told the user as a stop is (the log, the node's text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        armed = lazy_compile(patcher, **options)
    said = [str(warning.message) for warning in caught]
    for message in said:
        _PatcherTarget.notify(message)
    stats = compile_stats(armed)
    head = (f"armed {stats.units} block(s) in {stats.regions} region(s); they compile where the model runs next"
            if stats.applied else f"not compiled: {stats.reason}")
    return armed, "\n".join([head, *(message for message in said if message != stats.reason)])


def _handle_dynamic_vram(patcher: Any, settings: CompileSettings) -> Any:
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if not (callable(is_dynamic) and is_dynamic()):
        return patcher
    if not settings.disable_dynamic_vram:
        warnings.warn(DYNAMIC_VRAM_MESSAGE, stacklevel=4)
        return patcher
    if "disable_dynamic" not in inspect.signature(patcher.clone).parameters:
        warnings.warn("this ComfyUI core cannot demote a dynamic-VRAM MODEL; " + DYNAMIC_VRAM_MESSAGE, stacklevel=4)
        return patcher
    if applied_state(patcher.model) is not None:
        warnings.warn("a Streamwise-converted MODEL is not demoted: ComfyUI would rebuild it from its file without "
                      "the conversion; " + DYNAMIC_VRAM_MESSAGE, stacklevel=4)
        return patcher
    demoted = patcher.clone(disable_dynamic=True)
    if settings.verbose:
        log.info("demoted the MODEL to a non-dynamic patcher (%s) before compiling", type(demoted).__name__)
    return demoted
