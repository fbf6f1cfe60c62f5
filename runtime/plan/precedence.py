"""Which rule of a section decides a module when several select it.

The section's `exclude` always wins. Otherwise the most specific match decides (exact path >
path glob with more literal segments > regex > qualified class > short class > subclass). Rules
that tie agree or the policy is ambiguous: `RuleConflict` names both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .selectors import CompiledSelector, ModuleRef, Specificity


@dataclass(frozen=True)
class Decision:
    rule: Any
    specificity: Specificity


class RuleConflict(ValueError):
    def __init__(self, module: ModuleRef, first: Any, second: Any) -> None:
        self.module, self.first, self.second = module, first, second
        super().__init__(
            f"rules `{first.id}` and `{second.id}` select `{module.path or '<root>'}` equally specifically "
            f"but disagree ({first.decision} vs {second.decision})"
        )


def decide(
    rules: Sequence[tuple[Any, CompiledSelector]], module: ModuleRef, exclude: CompiledSelector | None = None
) -> Decision | None:
    """The rule that decides `module`, or None when no rule selects it or it is excluded."""
    if exclude is not None and exclude.matches(module):
        return None
    hits = [(spec, rule) for rule, selector in rules if (spec := selector.specificity(module)) is not None]
    if not hits:
        return None
    best = max(spec for spec, _ in hits)
    tied = [rule for spec, rule in hits if spec == best]
    for other in tied[1:]:
        if other.decision != tied[0].decision:
            raise RuleConflict(module, tied[0], other)
    return Decision(tied[0], best)
