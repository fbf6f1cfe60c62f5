"""A compile region: one lazily compiled callable shared by every block whose forward it is.

Invariants:
- compiled on its first call, never at arming;
- a compiler failure runs the region eagerly from then on, once warned and recorded; an error the eager forward
  raises too is the caller's own, and propagates with compilation left on;
- shapes are static until one changes, then dynamic in the dimensions that changed (torch's automatic dynamic):
  a decoder's growing sequence and KV cache cost one recompile, not one per token;
- every block of the region shares its graphs whatever its depth: a KV cache the model shares across layers reaches
  each block as its view of its own slot (`cache_slots`);
- the cache limit holds in the thread and context that runs a call (torch 2.13 keeps config per context): torch
  takes it per compiled callable, else it is patched around every call; hitting it is recorded
  and told, as a compiler failure is (through the host's `notify` as well as a warning);
- what each call compiled (graphs, breaks, seconds, recompile reasons) is folded into the shared `CompileStats`.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
from torch import nn

from ...schemas import CompileSettings
from ..engine import protocol
from .cache_slots import TRACING, CacheSlots
from .settings import cache_limits

log = logging.getLogger("streamwise.compile")


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
    """Why compiling stopped, per region: a compiler failure (the region runs eagerly), or the recompile limit
    (shapes no compiled graph takes run eagerly)."""
    compile_seconds: float = 0.0


class Region:
    """One compiled callable shared by every block of one forward; compiled on its first call."""

    def __init__(self, function: Callable, settings: CompileSettings, stats: CompileStats,
                 per_call_names: tuple[str, ...] = (), notify: Callable[[str], None] = lambda message: None,
                 formats: Iterable[Any] = ()) -> None:
        self.function, self.settings, self.stats = function, settings, stats
        self.per_call_names, self.notify, self.formats = per_call_names, notify, tuple(formats)
        self.compiled = None
        self.prepared: set[torch.device] = set()
        self.failed = False
        self.has_graph = False
        self.at_limit = False
        limits = cache_limits(settings.dynamo_cache_size_limit, per_code="recompile_limit" not in _COMPILE_TAKES)
        self.slots = CacheSlots()
        self.patchers = {viewed: _patcher({**limits, **(TRACING if viewed else {})}) for viewed in (False, True)}

    def _compile(self):
        # `dynamic=False` would force every shape static (a decoder: one graph per token); None is torch's
        # automatic dynamic, static until a dimension changes. True traces every dimension symbolically at once.
        dynamic = True if self.settings.dynamic else None
        options = {"guard_filter_fn": guard_filter(self.per_call_names)} if self.settings.use_guard_filter else {}
        if self.settings.mode != "default":  # torch takes a mode or options, not both: the mode's own options
            from torch._inductor import list_mode_options

            options = {**list_mode_options(self.settings.mode, dynamic), **options}
        return torch.compile(self.function, backend=self.settings.backend, fullgraph=self.settings.fullgraph,
                             dynamic=dynamic, options=options or None, **self._per_region())

    def _per_region(self) -> dict:
        """What torch (2.13+) keeps per compiled callable: its own recompile limit, applied where its frames
        compile, and its own cache entries, so one arming that hit its limit, or was armed with other settings,
        does not use up the next one's."""
        limit = {"recompile_limit": self.settings.dynamo_cache_size_limit}
        return {key: value for key, value in {**limit, "isolate_recompiles": True}.items() if key in _COMPILE_TAKES}

    def __call__(self, module: nn.Module, *args, **kwargs):
        if self.failed:
            return self.function(module, *args, **kwargs)
        if self.compiled is None:
            self.compiled = self._compile()
        from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

        if self.formats:
            self._prepare(args, kwargs)
        args, kwargs, viewed = self.slots.bind(module, args, kwargs)
        patch = self.patchers[viewed]
        before = (_graphs(), _graph_breaks(), perf_counter(), len(self._failures()))
        revert = patch() if patch else None
        tree = self._tree(module)
        try:
            with nullcontext() if tree is None else tree.fetcher.around_block(module):
                result = self.compiled(module, *args, **kwargs)
        except (TorchDynamoException, FailOnRecompileLimitHit) as exc:  # the second: the limit under fullgraph
            failure = exc
        else:
            self._count(module, *before)
            return result
        finally:
            if revert is not None:
                revert()
        return self._fall_back(failure, module, args, kwargs)  # outside the handler: no dynamo traceback attached

    @staticmethod
    def _tree(block: nn.Module) -> Any:
        """The streamed tree `block` lies in (its first converted module's: a few steps into it), or None: its
        fetcher works around the graph."""
        return next((tree for module in block.modules() if (tree := protocol.tree_of(module)) is not None), None)

    def _prepare(self, args: tuple, kwargs: dict) -> None:
        """Before the first graph on a device is traced: the quant formats of the model's residents make there what
        their kernels read (GGUF's lookup tables), which the graphs then read as inputs instead of breaking where
        they are made."""
        inputs = itertools.chain(args, kwargs.values())
        device = next((value.device for value in inputs if isinstance(value, torch.Tensor)), None)
        if device is None or device in self.prepared:
            return
        self.prepared.add(device)
        for handler in self.formats:
            handler.prepare(device)

    def _fall_back(self, failure: Exception, module: nn.Module, args: tuple, kwargs: dict):
        """The model's own errors surface while dynamo traces it too: if the eager forward raises, the error is
        the caller's and compilation stays on; if it runs, the compiler failed, for good."""
        result = self.function(module, *args, **kwargs)
        self.failed = True
        cause = getattr(failure, "inner_exception", None) or failure.__cause__ or failure
        reason = f"{type(module).__name__}: {type(cause).__name__}: {cause}".splitlines()[0]
        self.stats.fallbacks.append(reason)
        self._tell(f"torch.compile failed, running it eagerly from now on ({reason})")
        return result

    def _tell(self, message: str) -> None:
        warnings.warn(message, stacklevel=4)
        self.notify(message)

    def _count(self, module: nn.Module, graphs: int, breaks: int, start: float, failures: int) -> None:
        """Fold what a call compiled into the stats: new graphs, their breaks and time, recompile reasons. A call
        whose guards all failed (a recompile reason) yet made no graph hit the recompile limit."""
        new_graphs = _graphs() - graphs
        if not new_graphs:
            if len(self._failures()) > failures and not self.at_limit:
                self._note_limit(module, self._failures()[failures:])
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

    def _note_limit(self, module: nn.Module, new_failures: list) -> None:
        self.at_limit = True
        limit = self.settings.dynamo_cache_size_limit
        reason = (f"{type(module).__name__}: hit the recompile limit ({limit} graphs): inputs no compiled graph takes "
                  f"run eagerly from now on (last reason: {str(new_failures[-1]).splitlines()[0]}); raise "
                  "dynamo_cache_size_limit or turn dynamic_shape_tracing on")
        self.stats.fallbacks.append(reason)
        self._tell(f"torch.compile stopped compiling: {reason}")

    def _note_recompile(self, new_failures: list) -> None:
        """Keep the guard failure behind a recompile: the newest cache entry's, first line."""
        reason = str(new_failures[0]).splitlines()[0] if new_failures else "unknown reason"
        self.stats.recompiles.append(reason)
        if self.settings.verbose:
            log.info("recompiled %s: %s", self.function.__qualname__, reason)


setattr(Region, protocol.REGION, True)  # a marker, not a class check: a pack imported twice has two classes


def is_region_forward(value: object) -> bool:
    """Whether `value` is a forward installed by arming (a region bound to its unit)."""
    return callable(getattr(value, "func", None)) and getattr(value.func, protocol.REGION, False)


def guard_filter(per_call_names: tuple[str, ...]) -> Callable[[list], list[bool]]:
    """Drop guards on per-call dictionaries (their contents change every call: guarding only forces recompiles)."""

    def keep(entries) -> list[bool]:
        return [not any(name in entry.name for name in per_call_names) for entry in entries]

    return keep


_COMPILE_TAKES = set(inspect.signature(torch.compile).parameters)


def _patcher(changes: dict) -> Callable[[], Callable[[], None]] | None:
    """Sets `changes` in dynamo's config for one call, returning their undo: the closure patcher torch itself puts
    around every call of a function compiled with `dynamic=`, a tenth of a `config.patch` context's cost."""
    return torch._dynamo.config._make_closure_patcher(**changes) if changes else None


def _graphs() -> int:
    """Graphs dynamo has compiled in this process (a restarted analysis is not a second graph)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
