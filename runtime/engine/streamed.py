"""Streamed leaves: the original class, plus the low-VRAM protocol (`protocol`), computing through a leaf kind.

`streaming_class(cls, kind)` derives the one class every streamed leaf of `cls` shares. Its forward has one
shape for every leaf, float or quantized:
- resident (the protocol's flags clear): the kind's resident forward, for float kinds the original forward
  itself (no copies, one flag check);
- fetching: fetch the weights through the tree's fetcher onto the input's device, compute, release.

A streamed module that also holds buffers (a `generic` one: its kind fetches parameters only) derives from the
relocating class, so its buffers follow the compute device as a relocating container's do.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from . import protocol, row_reads
from .classes import derived_class
from .file_tier import kept_in_file
from .kinds import COMPUTE_KINDS
from .relocating import relocating_class


def streaming_class(cls: type[nn.Module], kind: str, relocating: bool = False) -> type[nn.Module]:
    """The streamed counterpart of `cls` computing as the compute kind `kind` (`relocating`: its buffers follow
    the compute device)."""
    base = relocating_class(cls) if relocating else cls
    return derived_class(streaming_class, (cls, kind, relocating), f"Streamed{cls.__name__}", base,
                         lambda: leaf_namespace(cls, COMPUTE_KINDS[kind]))


def holds_parameters_below(module: nn.Module) -> bool:
    """Whether children of `module` hold parameters: a streamed module like that is a container (only `generic`
    computes one), which hosts that place leaves never place."""
    return bool(module._modules) and any(True for child in module.children() for _ in child.parameters())


def claimed_below(module: nn.Module) -> tuple[nn.Module, ...]:
    """What a generic container fetches besides its own parameters: each descendant holding some
    (`protocol.CLAIMED`; their names are read at each fetch, so a resident's storage is what travels)."""
    return tuple(descendant for descendant in module.modules() if descendant is not module
                 and any(tensor is not None for tensor in descendant._parameters.values()))


def leaf_namespace(cls: type[nn.Module], kind: Any) -> dict[str, object]:
    """The class body of a streamed leaf of `cls` computing with `kind` (a compute kind or a resident's)."""
    input_name = _input_name(cls.forward)
    original_apply = cls._apply
    by_rows = row_reads.KINDS.get(kind.name)  # the kinds that can read a weight on the file tier by rows

    def streamed(self: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        x, args = kind.split(self, input_name, args, kwargs)
        tree = protocol.tree_of(self)
        tree.compute_device = x.device  # the activations' device: the one signal that never lies
        if by_rows is not None and not args and not kwargs:
            reads = row_reads.reading_by_rows(self, kind.name)
            if reads is not None:  # a large weight left in its file, read a few rows at a time
                return row_reads.computed_by_rows(reads, self, x)
        fetched = kind.fetch(tree.fetcher, self, x)
        try:
            return kind.compute(self, x, fetched, *args, **kwargs)
        finally:
            kind.release(tree.fetcher, self, fetched)

    def _apply(self: nn.Module, fn, *args, **kwargs):
        with kept_in_file(self, fn):  # a unit's weights left in their file stay there through device moves
            return original_apply(self, fn, *args, **kwargs)

    return {
        **protocol.LEAF_DEFAULTS,
        "forward": protocol.leaf_forward(kind.resident_forward(cls), streamed),
        "_apply": _apply,
        "__doc__": f"{cls.__qualname__}, streamed by Streamwise (compute kind `{kind.name}`).",
        protocol.KIND: kind.name,
    }


def _input_name(forward) -> str | None:
    """The name of the input parameter of `forward` (its first after self), for calls by keyword."""
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    first = parameters[0] if parameters else None
    return first.name if first is not None and first.kind is not first.VAR_POSITIONAL else None
