"""Selector syntax and matching: whole-path, segment-aware globs; full-match regexes; class names."""

from __future__ import annotations

import pytest

from streamwise.runtime.plan.selectors import CompiledSelector, ModuleRef, outermost, walk_modules
from streamwise.schemas import Selector
from streamwise.schemas.patterns import PatternError, compile_glob, glob_matches


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
    import torch

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
    import torch

    module = ref("x", torch.nn.Linear(2, 2))
    assert (module.name, module.qualname) == ("Linear", "torch.nn.modules.linear.Linear")


def test_a_live_modules_class_verdict_is_the_refs():
    import torch

    selector = CompiledSelector(Selector(**{"class": "Linear", "subclasses": True}, path="head"))
    for path, module in [("a", torch.nn.Linear(2, 2)), ("head", torch.nn.ReLU()), ("b", torch.nn.ReLU())]:
        assert selector.matches_module(path, module) is selector.matches(ref(path, module))


def test_walk_modules_is_named_modules():
    import torch

    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(shared, torch.nn.ReLU()), shared, torch.nn.Linear(2, 2))
    model.add_module("empty", None)
    assert walk_modules(model) == list(model.named_modules())


def test_outermost_keeps_only_matches_inside_no_other():
    import torch

    def block():
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))

    model = torch.nn.Sequential(block(), torch.nn.Linear(2, 2), block())
    units = outermost(CompiledSelector(Selector(path=["*", "*.1"])), model)
    assert [path for path, _ in units] == ["0", "1", "2"]  # `0.1` and `2.1` lie inside units
    assert units[0][1] is model[0]
