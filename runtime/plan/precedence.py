"""Which rule of a section decides a module when several select it.

The section's `exclude` always wins. Otherwise the most specific match decides (exact path >
path glob with more literal segments > regex > qualified class > short class > class glob > subclass >
`holds`). Rules that tie agree or the policy is ambiguous: `RuleConflict` names both.

Every path or regex match outranks every class match, and every class match outranks `holds`, so a
`Section` decides the class rules once per class, tries the rules with path or regex entries per path,
and looks at what a module holds only when nothing else decided it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import Error
from .selectors import ClassNames, CompiledSelector, ModuleRef, PerClass, Specificity, class_names, holds

Hits = Sequence[tuple[Specificity, Any]]  # (specificity, rule) in rule order


@dataclass(frozen=True)
class Decision:
    rule: Any
    specificity: Specificity


class RuleConflict(Error, ValueError):
    def __init__(self, module: ModuleRef, first: Any, second: Any) -> None:
        self.module, self.first, self.second = module, first, second
        super().__init__(
            f"rules `{first.id}` and `{second.id}` select `{module.path or '<root>'}` equally specifically "
            f"but disagree ({first.decision} vs {second.decision})"
        )


@dataclass(frozen=True)
class _ClassVerdict:
    """What a section's class entries make of one class: excluded, and the decision of its class rules."""

    names: ClassNames
    excluded: bool
    decision: Decision | None
    rival: Any = None  # a rule that ties with the decision's and disagrees


class Section:
    """One section's rules (with their compiled selectors, in order) and its `exclude`, compiled once."""

    def __init__(self, rules: Sequence[tuple[Any, CompiledSelector]], exclude: CompiledSelector | None = None) -> None:
        self.rules = list(rules)
        self.exclude = exclude
        self.by_path = [(rule, selector) for rule, selector in self.rules if selector.by_path]
        self.by_holds = [(rule, selector) for rule, selector in self.rules if selector.holds is not None]
        self._exclude_by_module = exclude is not None and exclude.by_module
        # which rules a class can meet: those naming one of its names, and those a glob or a base lets name any
        self._by_name: dict[str, list[int]] = {}
        self._any_class: list[int] = []
        for index, (_, selector) in enumerate(self.rules):
            if selector.class_keys is None:
                self._any_class.append(index)
            for name in selector.class_keys or ():
                self._by_name.setdefault(name, []).append(index)
        self.of_class: PerClass[_ClassVerdict] = PerClass(lambda cls: self._verdict(class_names(cls)))
        """The class part of every decision for instances of a class, worked out once: `of_class[cls]`."""

    @property
    def path_dependent(self) -> bool:
        """Whether a decision of this section can depend on the path, not only on the class (and `holds`)."""
        return bool(self.by_path) or (self._exclude_by_module and self.exclude.by_path)

    @property
    def holds_dependent(self) -> bool:
        """Whether a decision of this section can depend on what a module holds."""
        return bool(self.by_holds) or (self._exclude_by_module and self.exclude.holds is not None)

    def decide(self, path: str, module: object) -> Decision | None:
        """The rule that decides `module` at `path`, or None when no rule selects it or it is excluded."""
        verdict = self.of_class[type(module)]
        if verdict.excluded or (self._exclude_by_module and self.exclude.module_specificity(path, module)):
            return None
        decision, rival = verdict.decision, verdict.rival
        if self.by_path:
            hits = [(spec, rule) for rule, selector in self.by_path if (spec := selector.path_specificity(path))]
            if hits:
                decision, rival = _pick(hits)
        if decision is None and self.by_holds:
            held = holds(module)
            hits = [(spec, rule) for rule, selector in self.by_holds if (spec := selector.holds_specificity(held))]
            if hits:
                decision, rival = _pick(hits)
        if rival is not None:
            raise RuleConflict(ModuleRef(path, verdict.names), decision.rule, rival)
        return decision

    def _verdict(self, names: ClassNames) -> _ClassVerdict:
        excluded = self.exclude is not None and self.exclude.class_specificity(names) is not None
        short, qualified = names[0]
        met = sorted({*self._any_class, *self._by_name.get(short, ()), *self._by_name.get(qualified, ())})
        hits = [(spec, rule) for rule, selector in map(self.rules.__getitem__, met)
                if (spec := selector.class_specificity(names))]
        return _ClassVerdict(names, excluded, *(_pick(hits) if hits else (None, None)))


def decide(
    rules: Sequence[tuple[Any, CompiledSelector]], module: ModuleRef, exclude: CompiledSelector | None = None
) -> Decision | None:
    """The rule that decides `module`, or None when no rule selects it or it is excluded."""
    if exclude is not None and exclude.matches(module):
        return None
    hits = [(spec, rule) for rule, selector in rules if (spec := selector.specificity(module)) is not None]
    if not hits:
        return None
    decision, rival = _pick(hits)
    if rival is not None:
        raise RuleConflict(module, decision.rule, rival)
    return decision


def _pick(hits: Hits) -> tuple[Decision, Any]:
    """The most specific hit (the first in rule order among equals), and a tied rule that disagrees, if any."""
    best = max(spec for spec, _ in hits)
    tied = [rule for spec, rule in hits if spec == best]
    rival = next((other for other in tied[1:] if other.decision != tied[0].decision), None)
    return Decision(tied[0], best), rival
