"""What arming touches: a plain module, or a host's model through the target its host registered.

Invariants:
- the compile stage knows no host: a host registers, under its name in `HOST_TARGETS`, a function that recognizes
  its models and returns the `Target` for one (or None for anything else); ComfyUI's MODEL is registered by
  `hosts/comfyui/compile.py` when the ComfyUI host is imported;
- a plain module's forwards go into each unit's instance dict, and `disarm` restores what was there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...schemas import CompileSettings
from ..engine import protocol
from ..registry import Registry
from .errors import CompileError
from .regions import CompileStats, Region


@dataclass
class Armed:
    """Kept on what was armed: the stats, and each unit with the per-instance forward it had, if any."""

    stats: CompileStats
    units: list[tuple[nn.Module, Any]]


class Target:
    """What arming touches: the tree to search for units, where their forwards go, and where its state lives.

    This one is a plain module: forwards go into each unit's instance dict. Hosts subclass it (a ComfyUI MODEL
    installs them as object patches, and has per-call dictionaries whose guards are dropped).
    """

    per_call_names: tuple[str, ...] = ()

    def __init__(self, holder: Any, module: nn.Module) -> None:
        self.holder, self.module = holder, module

    def prepared(self, settings: CompileSettings) -> Target:
        """The target to arm under `settings` (a host may swap in a copy of its model)."""
        return self

    def install(self, path: str, unit: nn.Module, forward: Any, own: Any, armed: Armed) -> None:
        """Make `forward` the one `unit` runs; `own` is the per-instance forward it replaces, if any."""
        armed.units.append((unit, own))
        unit.__dict__["forward"] = forward

    def remove(self, armed: Armed) -> None:
        for unit, own in armed.units:
            if own is None:
                unit.__dict__.pop("forward", None)
            else:
                unit.__dict__["forward"] = own

    @staticmethod
    def notify(message: str) -> None:
        """Tell the user, beyond the warning, that compiling stopped (a host shows it where its users look).
        Static: a region holding it must not hold the target, whose holder holds the region (a cycle)."""

    def regions(self) -> list[Region]:
        """The regions armed on this target now (a host may hold them where arming state is not copied)."""
        armed = self.holder.__dict__.get(protocol.COMPILE_STATE)
        return [unit.__dict__["forward"].func for unit, _ in armed.units] if armed else []


#: Per host, the function that returns the target for one of its models, or None for anything else.
HOST_TARGETS: Registry[Callable[[Any], Target | None]] = Registry("compile target")


def target_for(model: Any) -> Target:
    """The target for `model`: a plain module's own, else the first registered host's that recognizes it."""
    if isinstance(model, nn.Module):
        return Target(model, model)
    for name in HOST_TARGETS:
        target = HOST_TARGETS[name](model)
        if target is not None:
            return target
    hosts = ", ".join(map(str, HOST_TARGETS)) or "none"
    raise CompileError(f"cannot compile a {type(model).__name__}: expected a torch module or a model of a host that "
                    f"registered a compile target (registered: {hosts})")
