"""Which rule decides a module when several select it (docs/policy-format.md: "Precedence")."""

from __future__ import annotations

import pytest

from streamwise.runtime.plan.precedence import RuleConflict, Section, decide
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


@pytest.mark.parametrize("path, cls", [("model.lm_head", Linear), ("a", Linear), ("a", FusedLinear), ("x.0", Linear)])
def test_a_section_decides_as_decide_does(path, cls):
    rules = [
        quant("family", "int8", **{"class": "Linear", "subclasses": True}),
        quant("fused", "none", **{"class": "Fused*"}),  # a glob names any class: met by every class, not by name
        quant("head", "none", path="model.lm_head"),
        quant("first", "int8", regex=[r".*\.0"]),
    ]
    exclude = CompiledSelector(Selector(path="a", **{"class": "FusedLinear"}))
    for excluded in (None, exclude):
        section = Section(rules, excluded)
        expected = decide(rules, module(path, cls), excluded)
        assert section.decide(path, cls()) == expected
        assert section.decide(path, cls()) == expected  # and again, from the class's cached verdict


def test_a_section_reports_a_class_tie_per_module():
    section = Section([quant("a", "int8", **{"class": "Linear"}), quant("b", "none", **{"class": "Linear"})])
    for path in ("x", "y"):
        with pytest.raises(RuleConflict) as raised:
            section.decide(path, Linear())
        assert raised.value.module.path == path


def test_what_a_module_holds_decides_only_what_no_class_or_path_rule_did():
    from torch import nn

    rules = [quant("by-class", "int8", **{"class": "Linear"}), quant("by-holds", "none", holds="parameters")]
    section = Section(rules)
    for path, held in (("a", nn.Linear(2, 2)), ("b", nn.LayerNorm(2)), ("c", nn.ReLU())):
        assert section.decide(path, held) == decide(rules, ModuleRef.of(path, held))
    assert section.decide("a", nn.Linear(2, 2)).rule.id == "by-class"  # a class match outranks `holds`
    assert section.decide("b", nn.LayerNorm(2)).rule.id == "by-holds"
    assert section.decide("c", nn.ReLU()) is None  # holds nothing: no rule selects it


def test_a_section_says_whether_a_decision_can_depend_on_the_path_or_on_what_a_module_holds():
    by_class = quant("class", "int8", **{"class": "Linear"})
    sections = {
        "classes only": Section([by_class]),
        "a path rule": Section([by_class, quant("path", "none", path="x")]),
        "a holds rule": Section([by_class, quant("holds", "none", holds="parameters")]),
        "a path exclude": Section([by_class], CompiledSelector(Selector(path="x"))),
        "a holds exclude": Section([by_class], CompiledSelector(Selector(holds="buffers-only"))),
        "a class exclude": Section([by_class], CompiledSelector(Selector(**{"class": "FusedLinear"}))),
    }
    assert {name: (s.path_dependent, s.holds_dependent) for name, s in sections.items()} == {
        "classes only": (False, False), "a path rule": (True, False), "a holds rule": (False, True),
        "a path exclude": (True, False), "a holds exclude": (False, True), "a class exclude": (False, False)}


def test_a_conflict_at_the_root_names_the_root():
    section = Section([quant("a", "int8", **{"class": "Linear"}), quant("b", "none", **{"class": "Linear"})])
    with pytest.raises(RuleConflict, match="select `<root>` equally specifically"):
        section.decide("", Linear())


def test_a_decision_cannot_be_changed_once_made():
    import dataclasses

    decision = decide([quant("a", "int8", **{"class": "Linear"})], module("x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.rule = None
