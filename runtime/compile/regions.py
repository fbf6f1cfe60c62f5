"""A compile region: one lazily compiled callable shared by every block whose forward it is.

Invariants:
- compiled on its first call, never at arming;
- a compiler failure runs the region eagerly from then on, once warned and recorded; an error the eager forward
  raises too is the caller's own, and propagates with compilation left on;
- what each call compiled (graphs, breaks, seconds, recompile reasons) is folded into the shared `CompileStats`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

import torch
from torch import nn

from ...schemas import CompileSettings

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
    compile_seconds: float = 0.0


class Region:
    """One compiled callable shared by every block of one forward; compiled on its first call."""

    _sw_region = True  # a marker, not a class check: ComfyUI may import this pack twice under two names

    def __init__(self, function: Callable, settings: CompileSettings, stats: CompileStats,
                 per_call_names: tuple[str, ...] = ()) -> None:
        self.function, self.settings, self.stats = function, settings, stats
        self.per_call_names = per_call_names
        self.compiled = None
        self.failed = False
        self.has_graph = False

    def _compile(self):
        options = {"guard_filter_fn": guard_filter(self.per_call_names)} if self.settings.use_guard_filter else {}
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
        """The model's own errors surface while dynamo traces it too: if the eager forward raises, the error is
        the caller's and compilation stays on; if it runs, the compiler failed, for good."""
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


def is_region_forward(value: object) -> bool:
    """Whether `value` is a forward installed by arming (a region bound to its unit)."""
    return callable(getattr(value, "func", None)) and getattr(value.func, "_sw_region", False)


def guard_filter(per_call_names: tuple[str, ...]) -> Callable[[list], list[bool]]:
    """Drop guards on per-call dictionaries (their contents change every call: guarding only forces recompiles)."""

    def keep(entries) -> list[bool]:
        return [not any(name in entry.name for name in per_call_names) for entry in entries]

    return keep


def _graphs() -> int:
    """Graphs dynamo has compiled in this process (a restarted analysis is not a second graph)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
