"""The state a converted tree keeps on its root (`AppliedState`): its `StreamTree`, the records that undo the
conversion, the plan it was converted by and where it was loaded from; and the error a conversion raises.

`convert` writes it; the stages above read it (a host placing the tree, a compile arming it, a load recording its
file tier).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from ...errors import Error
from ..engine import protocol
from ..engine.journal import Record
from ..engine.tree import StreamTree

if TYPE_CHECKING:
    from ..plan import Plan


class ConversionError(Error, RuntimeError):
    """A plan could not be applied to a tree; the tree is unchanged."""


@dataclass(frozen=True)
class ConversionCounts:
    """What a converted tree holds: streamed leaves per compute kind and relocating modules."""

    streamed: dict[str, int]
    relocating: int


@dataclass
class AppliedState:
    """Kept on the root module: the tree's streaming state and how to undo the conversion."""

    tree: StreamTree = field(default_factory=StreamTree)
    records: list[Record] = field(default_factory=list)
    plan: Plan | None = None
    source: str | None = None  # the folder the tree was built from, when it was (its tokenizer lives there)

    def counts(self) -> ConversionCounts:
        streamed: dict[str, int] = {}
        relocating = 0
        for record in self.records:
            if record.role == "stream":  # a record's modules were given one class alike: one kind
                kind = protocol.kind_of(record.modules[0])
                streamed[kind] = streamed.get(kind, 0) + len(record.modules)
            elif record.role == "relocate":
                relocating += len(record.modules)
        return ConversionCounts(dict(sorted(streamed.items())), relocating)


def applied_state(model: nn.Module) -> AppliedState | None:
    return model.__dict__.get(protocol.STATE)
