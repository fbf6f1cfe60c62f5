"""`extends`: how a policy builds on another one.

Merge rules, applied from the root of the chain down:
- `[policy]` and `[match]` belong to the file and are never inherited (an inherited `[match]` would give `auto`
  two candidates for the parent's models);
- in each rule section (`Policy.RULE_SECTIONS`: `[stream]`, `[relocate]`, `[quant]`), a rule replaces the
  parent's rule with the same id in place, new rules follow the parent's, and an `exclude` given by the child
  replaces the parent's (omit it to keep the parent's), so a child can adjust one rule without repeating the rest;
- in `[compile]`, every key the child sets overrides the parent's value.
"""

from __future__ import annotations

from typing import TypeVar

from ...schemas import Policy
from ...schemas.policy import RuleSection

SectionT = TypeVar("SectionT", bound=RuleSection)


def merge(parent: Policy, child: Policy) -> Policy:
    sections = {s: _merge_section(getattr(parent, s), getattr(child, s)) for s in Policy.RULE_SECTIONS}
    overrides = {key: getattr(child.compile, key) for key in child.compile.model_fields_set}
    return child.model_copy(update={**sections, "compile": parent.compile.model_copy(update=overrides)})


def _merge_section(parent: SectionT, child: SectionT) -> SectionT:
    rules = {rule.id: rule for rule in parent.rule}
    for rule in child.rule:
        rules[rule.id] = rule
    exclude = child.exclude if "exclude" in child.model_fields_set else parent.exclude
    return child.model_copy(update={"rule": tuple(rules.values()), "exclude": exclude})
