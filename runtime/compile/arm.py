"""Quantized Lazy Torch Compile: regional, lazy `torch.compile` driven by a policy's `[compile]`.

`lazy_compile` arms a tree and returns at once: nothing is traced until the first forward.
Blocks named by the policy's `blocks` selector are compiled regionally, one compiled callable per
block class, so N identical blocks compile once. Streamed leaves trace cleanly inside a block
(their resident fast path is the original forward). Trees holding ConvRot INT4 residents are
left eager (torch has no fake kernels for their packing). A compile error warns once, falls
back to eager for good, and never breaks inference (errors raised while the compiled code runs
are the model's own and propagate). `compile_stats` reports what happened. Dynamo's cache limits
are process-wide settings of torch: arming sets them for every compiled model in the process.
"""

from __future__ import annotations

import functools
import inspect
import logging
from time import perf_counter
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...schemas import CompileSettings, Policy
from ..engine.apply import applied_state
from ..policy.load import load_policy
from ..plan.selectors import CompiledSelector, ModuleRef, within

log = logging.getLogger("streamwise.compile")

STATE_ATTRIBUTE = "_sw_compile"
INT4_MESSAGE = "Native ConvRot INT4 detected; torch.compile was not applied."
DYNAMIC_VRAM_MESSAGE = (
    "Dynamic VRAM remains enabled for this MODEL; ComfyUI currently treats this combination as experimental "
    "because VBAR operations cause graph breaks."
)
#: Per-call dictionaries whose contents change every call: guarding on them only forces recompiles.
PER_CALL_DICTS = ("transformer_options", "model_options", "patches_replace")
#: `lazy_compile` keyword arguments that are not policy keys.
_NODE_NAMES = {"dynamic_shape_tracing": "dynamic"}


@dataclass
class CompileStats:
    applied: bool = False
    reason: str | None = None
    units: int = 0
    regions: int = 0
    graphs: int = 0
    recompiles: list[str] = field(default_factory=list)
    graph_breaks: int = 0
    fallbacks: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0


def compile_stats(model: Any) -> CompileStats:
    """What lazy compilation did to `model` (a module or a ComfyUI MODEL) so far."""
    if _is_patcher(model):
        regions = _patched_regions(model)
        if regions:
            return regions[0].stats
    state = model.__dict__.get(STATE_ATTRIBUTE)  # a MODEL left eager (ConvRot INT4) keeps its reason here
    if state is None:
        raise ValueError("this model was not armed with streamwise.lazy_compile")
    return state.stats


def lazy_compile(model: Any, policy: Policy | str | None = None, *, compile_transformer_blocks_only: bool = True, **overrides) -> Any:
    """Arm `model` (a module, or a ComfyUI MODEL) for compilation on its first forward; returns it.

    Without a policy, the `[compile]` settings of the plan the tree was converted by apply (else the
    defaults). Keyword overrides take the `[compile]` keys (`dynamic_shape_tracing` is `dynamic`).
    A MODEL is armed through object patches, which ComfyUI sets while it is loaded and undoes on
    unload, so the tree it shares with other MODELs (the one it was cloned from) is left alone.
    """
    patcher, module = (model, model.model) if _is_patcher(model) else (None, model)
    settings = _settings(policy, module, overrides)  # before anything changes: bad settings leave the model as it was
    if patcher is not None:
        patcher = _handle_dynamic_vram(patcher, settings)
        module = patcher.model
    disarm(patcher or module)
    armed = _Armed(CompileStats(), [])
    (patcher or module).__dict__[STATE_ATTRIBUTE] = armed
    if any(getattr(m, "compile_safe", True) is False for m in module.modules()):
        warnings.warn(INT4_MESSAGE, stacklevel=2)
        armed.stats.reason = INT4_MESSAGE
        return patcher or model
    _quiet_fetchers(module, settings)
    _set_cache_limits(settings.dynamo_cache_size_limit)
    units = _units(module, settings if compile_transformer_blocks_only else settings.model_copy(update={"blocks": None}))
    regions: dict[Any, _Region] = {}
    for path, unit in units:
        own = unit.__dict__.get("forward")  # a per-instance forward (hooks install these) is the one that runs
        if _is_armed_forward(own):  # another clone's compiled forward, set on the shared tree while it is loaded
            own = None
        function = _unbound_forward(unit, own)
        region = regions.setdefault(function, _Region(function, settings, armed.stats))
        forward = functools.partial(region, unit)
        if patcher is not None:
            patcher.add_object_patch(f"{path}.forward" if path else "forward", forward)
        else:
            unit.__dict__["forward"] = forward
            armed.units.append((unit, own))
    armed.stats.applied, armed.stats.units, armed.stats.regions = True, len(units), len(regions)
    if settings.verbose:
        log.info("armed %d unit(s) in %d region(s): backend=%s mode=%s fullgraph=%s dynamic=%s guard_filter=%s",
                 len(units), len(regions), settings.backend, settings.mode, settings.fullgraph, settings.dynamic,
                 settings.use_guard_filter)
    return patcher or model


def disarm(model: Any) -> None:
    """Undo `lazy_compile`: every unit runs its own forward again (a MODEL: from its next load)."""
    armed = model.__dict__.pop(STATE_ATTRIBUTE, None)
    if _is_patcher(model):
        for key in [k for k, v in model.object_patches.items() if _is_armed_forward(v)]:
            del model.object_patches[key]
        return
    for unit, own in armed.units if armed else ():
        if own is None:
            unit.__dict__.pop("forward", None)
        else:
            unit.__dict__["forward"] = own


def _unbound_forward(unit: nn.Module, own: Any):
    """The forward to compile for `unit`, as a function of (module, *args): its class's, or its own."""
    if own is None:
        return type(unit).forward
    if inspect.ismethod(own) and own.__self__ is unit:
        return own.__func__
    return lambda module, *args, **kwargs: own(*args, **kwargs)


def _is_armed_forward(value: Any) -> bool:
    # By marker, not class: ComfyUI may import this pack a second time under another module name.
    return isinstance(value, functools.partial) and getattr(value.func, "_sw_region", False)


def _patched_regions(patcher: Any) -> list["_Region"]:
    return [value.func for value in patcher.object_patches.values() if _is_armed_forward(value)]


@dataclass
class _Armed:
    stats: CompileStats
    units: list[tuple[nn.Module, Any]]  # each armed unit and the per-instance forward it had, if any


class _Region:
    """One compiled callable shared by every block of one class; compiled on its first call."""

    _sw_region = True

    def __init__(self, function, settings: CompileSettings, stats: CompileStats) -> None:
        self.function, self.settings, self.stats = function, settings, stats
        self.compiled = None
        self.failed = False
        self.has_graph = False

    def _compile(self):
        options = {"guard_filter_fn": _guard_filter} if self.settings.use_guard_filter else {}
        if self.settings.mode != "default":  # torch takes a mode or options, not both: the mode's own options
            from torch._inductor import list_mode_options

            options = {**list_mode_options(self.settings.mode, self.settings.dynamic), **options}
        return torch.compile(self.function, backend=self.settings.backend, fullgraph=self.settings.fullgraph,
                             dynamic=self.settings.dynamic, options=options or None)

    def __call__(self, module: nn.Module, *args, **kwargs):
        if self.failed:
            return self.function(module, *args, **kwargs)
        if self.compiled is None:
            self.compiled = self._compile()
        from torch._dynamo.exc import TorchDynamoException

        before = (_graphs(), _graph_breaks(), perf_counter(), len(self._failures()))
        try:
            result = self.compiled(module, *args, **kwargs)
        except TorchDynamoException as exc:
            failure = exc
        else:
            self._count(module, *before)
            return result
        return self._fall_back(failure, module, args, kwargs)  # outside the handler: no dynamo traceback attached

    def _fall_back(self, failure: Exception, module: nn.Module, args: tuple, kwargs: dict):
        """The model's own errors surface while dynamo traces it too: if the eager forward raises, the
        error is the caller's and compilation stays on; if it runs, the compiler failed, for good."""
        result = self.function(module, *args, **kwargs)
        self.failed = True
        cause = getattr(failure, "inner_exception", None) or failure.__cause__ or failure
        reason = f"{type(module).__name__}: {type(cause).__name__}: {cause}".splitlines()[0]
        self.stats.fallbacks.append(reason)
        warnings.warn(f"torch.compile failed, running it eagerly from now on ({reason})", stacklevel=3)
        return result

    def _count(self, module: nn.Module, graphs: int, breaks: int, start: float, failures: int) -> None:
        """Fold what a call compiled into the stats: new graphs, their breaks and time, recompile reasons."""
        new_graphs = _graphs() - graphs
        if not new_graphs:
            return
        self.stats.graphs += new_graphs
        self.stats.compile_seconds += perf_counter() - start
        self.stats.graph_breaks += _graph_breaks() - breaks
        if self.has_graph:
            self._note_recompile(self._failures()[failures:])
        self.has_graph = True
        if self.settings.verbose:
            log.info("%s: %d new graph(s) in %.2f s (%d in total)", type(module).__name__,
                     new_graphs, perf_counter() - start, self.stats.graphs)

    def _failures(self) -> list:
        from torch._dynamo.utils import guard_failures

        return guard_failures.get(self.function.__code__, [])

    def _note_recompile(self, new_failures: list) -> None:
        """Keep the guard failure behind a recompile: the newest cache entry's, first line."""
        reason = str(new_failures[0]).splitlines()[0] if new_failures else "unknown reason"
        self.stats.recompiles.append(reason)
        if self.settings.verbose:
            log.info("recompiled %s: %s", self.function.__qualname__, reason)


def _settings(policy: Policy | str | None, module: nn.Module, overrides: dict[str, Any]) -> CompileSettings:
    if policy is not None:
        base = (policy if isinstance(policy, Policy) else load_policy(policy)).compile
    else:  # the settings of the plan the tree was converted by, if any
        state = applied_state(module)
        base = state.plan.compile if state is not None and state.plan is not None else CompileSettings()
    updates = {_NODE_NAMES.get(key, key): value for key, value in overrides.items()}
    unknown = sorted(set(updates) - set(CompileSettings.model_fields))
    if unknown:
        raise TypeError(f"unknown compile setting(s): {', '.join(unknown)}")
    mode = updates.pop("mode", base.mode)
    settings = CompileSettings.model_validate({**base.model_dump(by_alias=True, exclude={"blocks"}), **updates, "blocks": base.blocks})
    _check_backend(settings.backend)
    if mode not in _modes():
        raise ValueError(f"compile mode `{mode}` is not one this torch accepts: {', '.join(sorted(_modes()))}")
    if mode != "default" and settings.backend != "inductor":
        raise ValueError(f"compile mode `{mode}` is an inductor setting; backend `{settings.backend}` takes none")
    return settings.model_copy(update={"mode": mode})


def _modes() -> set[str]:
    from torch._inductor import list_mode_options

    return {"default", *list_mode_options()}


def _check_backend(name: str) -> None:
    import torch._dynamo  # on first use: importing it costs a second of start-up

    if name not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"`{name}` is not a torch.compile backend here; available: {', '.join(torch._dynamo.list_backends())}")


def _set_cache_limits(limit: int) -> None:
    """Set only the limits this torch has (their names changed across releases)."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, limit)
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))


def _units(module: nn.Module, settings: CompileSettings) -> list[tuple[str, nn.Module]]:
    """The outermost modules of the block classes, with their paths (or the whole model)."""
    if settings.blocks is None:
        warnings.warn("no block classes to compile regionally; compiling the whole model", stacklevel=3)
        return [("", module)]
    selector = CompiledSelector(settings.blocks)
    units: list[tuple[str, nn.Module]] = []
    for path, child in module.named_modules():
        if selector.matches(ModuleRef.of(path, child)) and not any(within(path, p) for p, _ in units):
            units.append((path, child))
    if not units:
        warnings.warn("the policy's compile blocks match nothing in this model; compiling the whole model", stacklevel=3)
        return [("", module)]
    return units


def _quiet_fetchers(module: nn.Module, settings: CompileSettings) -> None:
    """A fetcher that prefetches on a side stream keeps Python bookkeeping a graph cannot hold."""
    state = applied_state(module)
    stop = getattr(state.tree.fetcher, "stop_prefetching", None) if state is not None else None
    if stop is not None:
        stop()
        if settings.verbose:
            log.info("side-stream prefetch turned off: compiled blocks fetch their weights inline")


def _guard_filter(entries) -> list[bool]:
    return [not any(key in entry.name for key in PER_CALL_DICTS) for entry in entries]


def _graphs() -> int:
    """Graphs dynamo has compiled in this process (a restarted analysis is not a second graph)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _is_patcher(model: Any) -> bool:
    return isinstance(getattr(model, "model", None), nn.Module) and hasattr(model, "load_device")


def _handle_dynamic_vram(patcher: Any, settings: CompileSettings) -> Any:
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if not (callable(is_dynamic) and is_dynamic()):
        return patcher
    if not settings.disable_dynamic_vram:
        warnings.warn(DYNAMIC_VRAM_MESSAGE, stacklevel=3)
        return patcher
    if "disable_dynamic" not in inspect.signature(patcher.clone).parameters:
        warnings.warn("this ComfyUI core cannot demote a dynamic-VRAM MODEL; " + DYNAMIC_VRAM_MESSAGE, stacklevel=3)
        return patcher
    if applied_state(patcher.model) is not None:  # core demotes by reloading the model from its file
        warnings.warn("a Streamwise-converted MODEL is not demoted: ComfyUI would rebuild it from its file without "
                      "the conversion; " + DYNAMIC_VRAM_MESSAGE, stacklevel=3)
        return patcher
    demoted = patcher.clone(disable_dynamic=True)
    if settings.verbose:
        log.info("demoted the MODEL to a non-dynamic patcher (%s) before compiling", type(demoted).__name__)
    return demoted
