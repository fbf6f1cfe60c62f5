"""Which rule decides a module when several select it (README: "Precedence")."""

from __future__ import annotations

import pytest

from streamwise.runtime.plan.precedence import RuleConflict, decide
from streamwise.runtime.plan.selectors import CompiledSelector, ModuleRef
from streamwise.schemas import QuantRule, Selector, StreamRule


class Linear:
    pass


class FusedLinear(Linear):
    pass


QUALIFIED_LINEAR = f"{Linear.__module__}.{Linear.__qualname__}"


def quant(rule_id: str, fmt: str, **select) -> tuple[QuantRule, CompiledSelector]:
    rule = QuantRule(id=rule_id, format=fmt, select=Selector(**select))
    return rule, CompiledSelector(rule.select)


def module(path: str, cls: type = Linear) -> ModuleRef:
    return ModuleRef.of(path, cls())


def winner(rules, path, cls=Linear, exclude=None):
    decision = decide(rules, module(path, cls), exclude)
    return None if decision is None else decision.rule.id


def test_exclude_beats_every_rule():
    rules = [quant("exact", "int8", path="model.lm_head")]
    exclude = CompiledSelector(Selector(**{"class": "Linear"}))
    assert winner(rules, "model.lm_head", exclude=exclude) is None
    assert winner(rules, "model.lm_head") == "exact"


@pytest.mark.parametrize(
    "stronger, weaker",
    [
        (dict(path="model.layers.0.mlp"), dict(path="model.layers.*.mlp")),  # exact path > glob
        (dict(path="model.layers.*.mlp"), dict(path="model.**.mlp")),  # more literal segments
        (dict(path="**.mlp"), dict(regex=[r"model\.layers\.0\.mlp"])),  # any glob > regex
        (dict(regex=[r".*\.mlp"]), {"class": "Linear"}),  # regex > class
        ({"class": QUALIFIED_LINEAR}, {"class": "Linear"}),  # qualified class > short class
    ],
)
def test_more_specific_rule_wins_regardless_of_order(stronger, weaker):
    rules = [quant("weak", "int8", **weaker), quant("strong", "none", **stronger)]
    assert winner(rules, "model.layers.0.mlp") == "strong"
    assert winner(list(reversed(rules)), "model.layers.0.mlp") == "strong"


def test_exact_class_beats_subclass_match():
    rules = [
        quant("family", "int8", **{"class": "Linear", "subclasses": True}),
        quant("fused", "none", **{"class": "FusedLinear"}),
    ]
    assert winner(rules, "a", FusedLinear) == "fused"
    assert winner(rules, "b", Linear) == "family"


def test_equal_specificity_and_disagreement_is_a_conflict_naming_both():
    rules = [quant("a", "int8", path="layers.*"), quant("b", "convrot_int8", path="*.0")]
    with pytest.raises(RuleConflict) as raised:
        decide(rules, module("layers.0"))
    assert {raised.value.first.id, raised.value.second.id} == {"a", "b"}
    assert "`a`" in str(raised.value) and "`b`" in str(raised.value)


def test_equal_specificity_rules_that_agree_are_fine():
    rules = [quant("a", "int8", path="layers.*"), quant("b", "int8", path="*.0")]
    assert winner(rules, "layers.0") == "a"


def test_stream_rules_disagree_on_kind():
    kinds = [
        (rule := StreamRule(id=i, kind=k, select=Selector(**{"class": "Linear"})), CompiledSelector(rule.select))
        for i, k in (("x", "linear"), ("y", "embedding"))
    ]
    with pytest.raises(RuleConflict):
        decide(kinds, module("a"))


def test_no_rule_selects_the_module():
    assert winner([quant("a", "int8", path="layers.*")], "head") is None
