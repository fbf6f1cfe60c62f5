"""`lazy_compile(model)`: arm a tree, or a host's model, for regional compilation on its first forward.

Invariants:
- arming returns at once; nothing is traced until the first forward;
- the units are the outermost modules of the policy's `[compile] blocks` (the converting plan's own when it has
  them), one region per block forward, so N identical blocks compile once;
- streamed leaves trace inside a block (resident, their forward is the original one; fetching, they read the
  views their unit's slot holds, or fetch inline where their host streams no units): the fetcher's bookkeeping
  runs around each block's graph (`Fetcher.around_block`, called by the region), never inside it;
- a tree holding residents of a format that cannot compile (ConvRot INT4) is left eager, and says why;
- a host's model (a ComfyUI MODEL) is armed through the target its host registered (`targets`); this stage never
  learns what a MODEL is;
- arming changes no torch setting: what a call needs (the cache limit on older torch, unspecialized ints where a
  cache view is passed) is set around that compiled call only (`regions`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

from torch import nn

from ...schemas import CompileSettings, Policy
from ..convert import applied_state
from ..engine import protocol
from ..plan.selectors import CompiledSelector, outermost
from .errors import CompileError
from .regions import CompileStats, Region, is_region_forward, log
from .settings import compile_settings
from .targets import Armed, target_for

INT4_MESSAGE = "Native ConvRot INT4 detected; torch.compile was not applied."


def lazy_compile(
    model: Any, policy: Policy | str | None = None, *, compile_transformer_blocks_only: bool = True, **overrides
) -> Any:
    """Arm `model` (a module, or a host's model such as a ComfyUI MODEL) for compilation; returns it (or the
    host's armed copy).

    Without a policy, the `[compile]` settings of the plan the tree was converted by (else the defaults).
    Keyword overrides take the `[compile]` keys (`dynamic_shape_tracing` is `dynamic`).
    """
    target = target_for(model)
    settings = compile_settings(policy, target.module, overrides)  # bad settings leave the model as it was
    target = target.prepared(settings)
    disarm(target.holder)
    armed = Armed(CompileStats(), [])
    target.holder.__dict__[protocol.COMPILE_STATE] = armed
    formats = {handler for handler in map(protocol.quant_handler, target.module.modules()) if handler}
    if any(not handler.compile_safe for handler in formats):
        warnings.warn(INT4_MESSAGE, stacklevel=2)
        armed.stats.reason = INT4_MESSAGE
        return target.holder
    _reads_outside_graphs(target.module)
    whole_model = settings.model_copy(update={"blocks": None})
    units = _units(target.module, settings if compile_transformer_blocks_only else whole_model)
    regions: dict[Any, Region] = {}
    for path, unit in units:
        own = unit.__dict__.get("forward")  # a per-instance forward (hooks install these) is the one that runs
        if is_region_forward(own):  # another clone's compiled forward, set on the shared tree while it is loaded
            own = None
        function = _unbound_forward(unit, own)
        region = regions.setdefault(function, Region(function, settings, armed.stats, target.per_call_names,
                                                                target.notify, formats))
        target.install(path, unit, functools.partial(region, unit), own, armed)
    armed.stats.applied, armed.stats.units, armed.stats.regions = True, len(units), len(regions)
    if settings.verbose:
        log.info("armed %d unit(s) in %d region(s): backend=%s mode=%s fullgraph=%s dynamic=%s guard_filter=%s",
                 len(units), len(regions), settings.backend, settings.mode, settings.fullgraph, settings.dynamic,
                 settings.use_guard_filter)
    return target.holder


def compile_stats(model: Any) -> CompileStats:
    """What lazy compilation did to `model` (a module, or a host's model) so far."""
    target = target_for(model)
    regions = target.regions()
    if regions:
        return regions[0].stats
    armed = target.holder.__dict__.get(protocol.COMPILE_STATE)  # an eager model (ConvRot INT4): its reason
    if armed is None:
        raise CompileError("this model was not armed with streamwise.lazy_compile")
    return armed.stats


def disarm(model: Any) -> None:
    """Undo `lazy_compile`: every unit runs its own forward again (a host's model: from its next load)."""
    target = target_for(model)
    armed = target.holder.__dict__.pop(protocol.COMPILE_STATE, None)
    target.remove(armed or Armed(CompileStats(), []))


def is_armed(model: Any) -> bool:
    return protocol.COMPILE_STATE in model.__dict__


def _units(module: nn.Module, settings: CompileSettings) -> list[tuple[str, nn.Module]]:
    """The outermost modules of the block classes, with their paths (or the whole model)."""
    if settings.blocks is None:
        warnings.warn("no block classes to compile regionally; compiling the whole model", stacklevel=3)
        return [("", module)]
    state = applied_state(module)
    if state is not None and state.plan is not None and state.plan.compile.blocks == settings.blocks:
        units = [(entry.path, module.get_submodule(entry.path)) for entry in state.plan.modules if entry.compile_unit]
    else:
        units = outermost(CompiledSelector(settings.blocks), module)
    if not units:
        warnings.warn("the policy's compile blocks match nothing in this model; compiling the whole model",
                      stacklevel=3)
        return [("", module)]
    return units


def _unbound_forward(unit: nn.Module, own: Any):
    """The forward to compile for `unit`, as a function of (module, *args): its class's, or its own."""
    if own is None:
        return type(unit).forward
    if inspect.ismethod(own) and own.__self__ is unit:
        return own.__func__
    return lambda module, *args, **kwargs: own(*args, **kwargs)


def _reads_outside_graphs(module: nn.Module) -> None:
    """Reads from the file tier run outside the graphs (a fetcher's own bookkeeping runs around each block's graph:
    `Fetcher.around_block`)."""
    state = applied_state(module)
    if state is not None and state.tree.file_tier is not None:
        state.tree.file_tier.read_outside_graphs()
