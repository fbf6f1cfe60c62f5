"""`extends`: how a policy builds on another one.

Merge rules, applied from the root of the chain down:
- `[policy]` and `[match]` belong to the file and are never inherited (an inherited `[match]` would give `auto`
  two candidates for the parent's models);
- in each rule section (`Policy.RULE_SECTIONS`: `[stream]`, `[relocate]`, `[quant]`), a rule replaces the
  parent's rule with the same id in place, new rules follow the parent's, and an `exclude` given by the child
  replaces the parent's (omit it to keep the parent's), so a child can adjust one rule without repeating the rest;
- in `[compile]`, every key the child sets overrides the parent's value.

A chain is folded in one pass, root first, each file's rules added to one table per section: linear in the rules of
the whole chain (merging pair by pair would copy the growing tables once per file).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...schemas import Policy


def merge_chain(chain: Sequence[Policy]) -> Policy:
    """The policy `chain[-1]` stands for, `chain` running from the root of its `extends` chain down to it."""
    root, child = chain[0], chain[-1]
    rules = {section: {rule.id: rule for rule in getattr(root, section).rule} for section in Policy.RULE_SECTIONS}
    excludes = {section: getattr(root, section).exclude for section in Policy.RULE_SECTIONS}
    overrides: dict[str, object] = {}
    for policy in chain[1:]:
        for section in Policy.RULE_SECTIONS:
            own = getattr(policy, section)
            rules[section].update((rule.id, rule) for rule in own.rule)
            if "exclude" in own.model_fields_set:
                excludes[section] = own.exclude
        overrides.update((key, getattr(policy.compile, key)) for key in policy.compile.model_fields_set)
    sections = {section: getattr(child, section).model_copy(update={
        "rule": tuple(rules[section].values()), "exclude": excludes[section]}) for section in Policy.RULE_SECTIONS}
    return child.model_copy(update={**sections, "compile": root.compile.model_copy(update=overrides)})
