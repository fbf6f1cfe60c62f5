"""Selector syntax and matching: whole-path, segment-aware globs; full-match regexes; class names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from streamwise.runtime.plan.selectors import (
    CompiledSelector,
    ModuleRef,
    declared_blocks,
    holds,
    joined,
    outermost,
    walk_modules,
)
from streamwise.schemas import Selector
from streamwise.schemas.patterns import PatternError, compile_glob, glob_matches
from streamwise.schemas.policy import BlockSelector


def glob(pattern: str, path: str) -> bool:
    return glob_matches(compile_glob(pattern), path)


@pytest.mark.parametrize(
    "pattern, path, expected",
    [
        ("kv_proj", "kv_proj", True),
        ("**.kv_proj", "model.layers.0.self_attn.qkv_proj", False),  # never a substring match
        ("**.kv_proj", "model.layers.0.self_attn.kv_proj", True),
        ("mlp.gate", "mlp.gate_proj", False),
        ("vision_tower.**", "model.vision_tower.blocks.0", False),  # always anchored at the root
        ("**.vision_tower.**", "model.vision_tower.blocks.0", True),
        ("**.vision_tower.**", "vision_tower", True),  # `**` may be empty on both sides
        ("layers.*", "layers.0", True),
        ("layers.*", "layers.0.mlp", False),  # `*` is exactly one segment
        ("layers.**", "layers", True),
        ("layers.*.mlp", "layers.12.mlp", True),
        ("layers.?.mlp", "layers.12.mlp", False),
        ("layers.[0-3].mlp", "layers.2.mlp", True),
        ("layers.[!0-3].mlp", "layers.7.mlp", True),
        ("layers.[!0-3].mlp", "layers.2.mlp", False),
        ("layers.1*", "layers.12", True),
        ("layers.1*", "layers.1.x", False),
        ("", "", True),  # the root module
        ("", "model", False),
        ("**", "", True),
        ("**", "a.b.c", True),
        ("model.lm_head", "model.lm_head", True),
        ("model.lm+head", "model.lm+head", True),  # regex metacharacters are literal in globs
    ],
)
def test_glob_semantics(pattern, path, expected):
    assert glob(pattern, path) is expected


@pytest.mark.parametrize("pattern", ["a..b", ".a", "a.", "a**", "**b.c", "a.[0-9", "a.]b", "a.[]"])
def test_bad_globs_are_refused(pattern):
    with pytest.raises(PatternError):
        compile_glob(pattern)


class Linear:  # stand-ins: matching sees only names, never the classes' code
    pass


class LoRALinear(Linear):
    pass


def ref(path: str, obj: object) -> ModuleRef:
    return ModuleRef.of(path, obj)


def test_regex_is_full_match():
    selector = CompiledSelector(Selector(regex=[r"layers\.\d+"]))
    assert selector.matches(ref("layers.3", Linear()))
    assert not selector.matches(ref("model.layers.3", Linear()))
    assert not selector.matches(ref("layers.3.mlp", Linear()))


def test_class_is_exact_unless_subclasses_are_asked_for():
    exact = CompiledSelector(Selector(**{"class": ["Linear"]}))
    assert exact.matches(ref("a", Linear()))
    assert not exact.matches(ref("a", LoRALinear()))
    with_subclasses = CompiledSelector(Selector(**{"class": ["Linear"], "subclasses": True}))
    assert with_subclasses.matches(ref("a", LoRALinear()))


def test_qualified_class_names_tell_equal_short_names_apart():
    qualified = f"{Linear.__module__}.{Linear.__qualname__}"
    selector = CompiledSelector(Selector(**{"class": [qualified]}))
    assert selector.matches(ref("a", Linear()))

    class Other:
        pass

    Other.__name__ = "Linear"  # same short name, different qualified name
    assert not selector.matches(ref("a", Other()))


def test_real_torch_classes_match_by_short_and_qualified_name():
    layer = torch.nn.Linear(2, 2)
    assert CompiledSelector(Selector(**{"class": "Linear"})).matches(ref("x", layer))
    assert CompiledSelector(Selector(**{"class": "torch.nn.modules.linear.Linear"})).matches(ref("x", layer))
    assert not CompiledSelector(Selector(**{"class": "torch.nn.Linear"})).matches(ref("x", layer))


def test_a_lone_string_is_a_one_item_list():
    assert Selector(**{"class": "Linear", "path": "a.b"}) == Selector(**{"class": ["Linear"], "path": ["a.b"]})


def test_brackets_inside_a_character_class_are_literal():
    assert glob("a[!]]", "ab") and not glob("a[!]]", "a]")
    assert glob("a[]x]", "a]") and glob("a[]x]", "ax") and not glob("a[]x]", "ab")


def test_a_module_ref_names_its_class_short_and_qualified():
    module = ref("x", torch.nn.Linear(2, 2))
    assert (module.name, module.qualname) == ("Linear", "torch.nn.modules.linear.Linear")


def test_a_live_modules_class_verdict_is_the_refs():
    selector = CompiledSelector(Selector(**{"class": "Linear", "subclasses": True}, path="head"))
    for path, module in [("a", torch.nn.Linear(2, 2)), ("head", torch.nn.ReLU()), ("b", torch.nn.ReLU())]:
        assert selector.matches_module(path, module) is selector.matches(ref(path, module))


def test_walk_modules_is_named_modules():
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(shared, torch.nn.ReLU()), shared, torch.nn.Linear(2, 2))
    model.add_module("empty", None)
    assert walk_modules(model) == list(model.named_modules())


def test_outermost_keeps_only_matches_inside_no_other():
    def block():
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))

    model = torch.nn.Sequential(block(), torch.nn.Linear(2, 2), block())
    units = outermost(CompiledSelector(Selector(path=["*", "*.1"])), model)
    assert [path for path, _ in units] == ["0", "1", "2"]  # `0.1` and `2.1` lie inside units
    assert units[0][1] is model[0]


# --- what each tier and entry means, one behaviour per mutant a reviewer would call plausible ----------------------

class Fused(nn.Linear):
    pass


def specificity(at: str, module: object, **select) -> tuple[int, int] | None:
    return CompiledSelector(Selector(**select)).specificity(ModuleRef.of(at, module))


def test_the_tiers_rank_as_the_readme_says_from_exact_path_down_to_holds():
    qualified = f"{nn.Linear.__module__}.{nn.Linear.__qualname__}"
    fused, linear = Fused(2, 2), nn.Linear(2, 2)
    ladder = [
        specificity("model.layers.0.mlp", linear, path="model.layers.0.mlp"),  # exact path
        specificity("model.layers.0.mlp", linear, path="model.layers.*.mlp"),  # glob, more literal segments
        specificity("model.layers.0.mlp", linear, path="model.**.mlp"),
        specificity("model.layers.0.mlp", linear, path="**"),  # a glob without a literal segment still beats a regex
        specificity("model.layers.0.mlp", linear, regex=r"model\.layers\.\d+\.mlp"),
        specificity("x", linear, **{"class": qualified}),
        specificity("x", linear, **{"class": "Linear"}),
        specificity("x", linear, **{"class": "Lin*"}),
        specificity("x", fused, **{"class": "Linear"}, subclasses=True),
        specificity("x", linear, holds="parameters"),
    ]
    assert None not in ladder and ladder == sorted(ladder, reverse=True) and len(set(ladder)) == len(ladder)


def test_a_selector_with_several_globs_is_as_specific_as_its_best_match():
    best = specificity("model.layers.0.mlp", nn.ReLU(), path=["**.mlp", "model.layers.0.mlp", "model.**"])
    assert best == specificity("model.layers.0.mlp", nn.ReLU(), path="model.layers.0.mlp")


def test_holds_sees_parameters_then_buffers_and_a_holds_entry_matches_exactly_that():
    rotary = nn.Module()
    rotary.register_buffer("inv_freq", torch.ones(2))
    assert (holds(nn.Linear(2, 2)), holds(rotary), holds(nn.ReLU())) == ("parameters", "buffers-only", None)
    for wanted, module in (("parameters", nn.Linear(2, 2)), ("buffers-only", rotary)):
        selector = CompiledSelector(Selector(holds=wanted))
        others = [m for m in (nn.Linear(2, 2), rotary, nn.ReLU()) if holds(m) != wanted]
        assert selector.matches_module("x", module) and selector.module_specificity("x", module) is not None
        assert not any(selector.matches_module("x", other) for other in others)


def test_subclasses_match_a_base_by_qualified_name_or_by_glob_too():
    qualified = f"{nn.Linear.__module__}.{nn.Linear.__qualname__}"
    for entry in (qualified, "Lin*", "torch.nn.**.Linear"):
        assert specificity("x", Fused(2, 2), **{"class": entry}, subclasses=True) is not None, entry
        assert specificity("x", Fused(2, 2), **{"class": entry}) is None, entry


def _declaring_tree(instance_declares=None):
    class Block(nn.Module):
        pass

    class Base(nn.Module):
        _no_split_modules = ["Other"]

    class Declaring(Base):
        _no_split_modules = ["Block"]  # the nearest class's declaration stands, not its bases' too

    class Other(nn.Module):
        pass

    root = Declaring()
    root.blocks = nn.ModuleList([Block(), Block()])
    root.other = Other()
    if instance_declares is not None:
        root._no_split_modules = instance_declares  # set on the instance when it is built
    return root


def test_no_split_takes_the_classes_the_tree_declares_and_a_plain_selector_does_not():
    root = _declaring_tree()
    declared = CompiledSelector(BlockSelector(no_split=True))
    assert [path for path, _ in outermost(declared, root)] == ["blocks.0", "blocks.1"]
    assert outermost(CompiledSelector(BlockSelector(**{"class": "Nothing"})), root) == []
    assert outermost(CompiledSelector(Selector(**{"class": "Nothing"})), root) == []


def test_an_instances_own_declaration_stands_over_its_classes():
    assert declared_blocks(walk_modules(_declaring_tree())) == {"Block"}
    assert declared_blocks(walk_modules(_declaring_tree(instance_declares=["Other"]))) == {"Other"}


def test_a_module_ref_cannot_be_changed():
    import dataclasses

    ref = ModuleRef.of("x", nn.Linear(2, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.path = "y"


def test_a_tensor_slot_holding_none_is_not_held():
    empty = nn.Module()
    empty.register_parameter("weight", None)
    empty.register_buffer("running_mean", None)
    assert holds(empty) is None


def test_a_root_that_matches_is_the_one_unit_and_everything_lies_inside_it():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert [path for path, _ in outermost(CompiledSelector(Selector(path="**")), model)] == [""]


def test_a_name_below_the_root_has_no_leading_dot():
    assert (joined("", "weight"), joined("model.layers.0", "weight")) == ("weight", "model.layers.0.weight")
