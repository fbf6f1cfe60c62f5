"""The committed JSON Schema is current, flat enough for TOML editors, and used by every policy."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamwise.runtime.policy.folders import SHIPPED_POLICY_DIR
from streamwise.runtime.policy.schema_export import SCHEMA_PATH, build_schema, render_schema

from helpers import REPO

DIRECTIVE = "#:schema ../schemas/policy.v1.schema.json"


def property_names(node, found=None):
    found = set() if found is None else found
    if isinstance(node, dict):
        found.update(node.get("properties", {}))
        for value in node.values():
            property_names(value, found)
    elif isinstance(node, list):
        for item in node:
            property_names(item, found)
    return found


def test_committed_schema_is_current():
    assert SCHEMA_PATH.read_text(encoding="utf-8") == render_schema(), (
        "schemas/policy.v1.schema.json is stale: run `python -m streamwise.runtime.policy.schema_export`"
    )


def test_schema_is_flat_for_editors():
    text = SCHEMA_PATH.read_text(encoding="utf-8")
    for construct in ('"$ref"', '"$defs"', '"allOf"', '"null"'):
        assert construct not in text
    schema = json.loads(text)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["stream"]["properties"]["rule"]["items"]["properties"]["kind"]["enum"][0] == "linear"


def test_every_shipped_policy_points_editors_at_the_schema():
    for path in SHIPPED_POLICY_DIR.glob("*.toml"):
        assert path.read_text(encoding="utf-8").splitlines()[0] == DIRECTIVE, path.name
        assert (path.parent / DIRECTIVE.split()[1]).resolve() == SCHEMA_PATH


def test_every_key_is_documented_in_the_template_and_the_policy_format_docs():
    keys = property_names(build_schema())
    template = (SHIPPED_POLICY_DIR / "_template.toml").read_text(encoding="utf-8")
    readme = (REPO / "docs" / "policy-format.md").read_text(encoding="utf-8")  # the format's reference
    assert [k for k in sorted(keys) if not re.search(rf"\b{k}\b", template)] == []
    documented = set(re.findall(r"`\[*([a-z_]+)", readme)) | set(re.findall(r"\[\[?[a-z_]+\.([a-z_]+)\]", readme))
    assert sorted(keys - documented) == []


# --- the schema and the validators agree ---------------------------------------------------------------------------
# Documents are drawn near the format's edges (each value valid or one step wrong), then both the JSON Schema and the
# pydantic models judge them. Two things a JSON Schema cannot say are kept out of the draws and stay the validators'
# alone: whether a glob or regex compiles in RE2 (so patterns are drawn valid), and TOML's integer type (a TOML float
# 16.0 is the number 16 to a schema: integers are checked as TOML integers here, as an editor reading TOML sees them).

NAMES = st.sampled_from(["linear", "r1", "a.b", "a-b", "_x", "x.", "9", "", "a..b", ".a", "-a", "a b", "a/b", "é",
                         "a\n", "x" * 300])
CLASS_ENTRIES = st.sampled_from(["Linear", "torch.nn.Linear", "*RMSNorm", "transformers.**.*Norm", "Qwen2?", "",
                                 "1Linear", "a..b", "Lin ear", "a.", "*" * 1001, "Linear\n"])
PATTERNS = st.sampled_from(["layers.*", "**.mlp.*", "model.layers.[0-9]", "x" * 1001])
REGEXES = st.sampled_from([r"model\.layers\.\d+", "a|b", "x" * 1001])
WRONG = st.sampled_from([None, 1, 1.5, True, "x", [], {}])


def entries(strategy):
    return st.one_of(strategy, st.lists(strategy, max_size=2))


SELECTORS = st.fixed_dictionaries({}, optional={
    "class": entries(CLASS_ENTRIES), "path": entries(PATTERNS), "regex": entries(REGEXES),
    "subclasses": st.booleans(), "holds": st.sampled_from(["parameters", "buffers-only", "all"]),
})
BLOCKS = st.fixed_dictionaries({}, optional={"class": entries(CLASS_ENTRIES), "no_split": st.booleans()})


def maybe_wrong(strategy):
    return st.one_of(strategy, strategy, strategy, WRONG)


def rule(**extra):
    return st.fixed_dictionaries({"id": maybe_wrong(NAMES), "select": maybe_wrong(SELECTORS)},
                                 optional={"optional": maybe_wrong(st.booleans()), **extra})


STREAM = rule(kind=st.sampled_from(["linear", "generic", "auto", "magic"]))
QUANT = rule(format=st.sampled_from(["int8", "gguf", "convrot_int8", "convrot_int4", "none", "fp3"]),
             group_size=st.one_of(st.sampled_from([1, 4, 16, 32, 256, 4**31, 4**32, -16]), WRONG),
             gguf_type=st.sampled_from(["Q8_0", "Q4_0", "Q9_9"]), min_weights=st.sampled_from([0, 10, -1, 1.0]))
COMPILE = st.fixed_dictionaries({}, optional={
    "enabled": maybe_wrong(st.booleans()), "backend": st.sampled_from(["inductor", "eager", "2x", "a b", "x\n"]),
    "mode": st.sampled_from(["default", "max-autotune", "fast"]), "blocks": maybe_wrong(BLOCKS),
    "dynamo_cache_size_limit": st.sampled_from([1, 64, 0, 65537, 8.0]), "unknown": st.just(1),
})
DOCUMENTS = st.fixed_dictionaries(
    {"schema_version": st.sampled_from([1, 1, 1, 2, True, "1"]),
     "policy": st.fixed_dictionaries({"name": maybe_wrong(NAMES)}, optional={
         "extends": maybe_wrong(NAMES), "description": st.text(max_size=5)})},
    optional={
        "stream": st.fixed_dictionaries({}, optional={"rule": st.lists(STREAM, max_size=2),
                                                      "exclude": maybe_wrong(SELECTORS)}),
        "quant": st.fixed_dictionaries({}, optional={"rule": st.lists(QUANT, max_size=2)}),
        "relocate": st.fixed_dictionaries({}, optional={"rule": st.lists(rule(), max_size=2)}),
        "match": st.fixed_dictionaries({}, optional={"classes": entries(CLASS_ENTRIES), "fallback": st.booleans(),
                                                     "state_dict_keys": entries(PATTERNS)}),
        "compile": COMPILE,
        "extra": st.just({}),
    },
)


def toml_validator():
    import jsonschema

    integers = jsonschema.Draft7Validator.TYPE_CHECKER.redefine(  # TOML's integers: a float is never one
        "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool))
    return jsonschema.validators.extend(jsonschema.Draft7Validator, type_checker=integers)(build_schema())


@settings(max_examples=400, deadline=None)
@given(DOCUMENTS)
def test_the_schema_accepts_exactly_what_validation_accepts(document):
    from pydantic import ValidationError

    from streamwise.schemas import Policy

    schema_accepts = toml_validator().is_valid(document)
    try:
        Policy.model_validate(document)
    except ValidationError:
        validation_accepts = False
    else:
        validation_accepts = True
    assert schema_accepts == validation_accepts, (document, list(toml_validator().iter_errors(document))[:2])


@pytest.mark.parametrize("change", [
    {"stream": {"rule": [{"id": "r", "select": {}, "kind": "linear"}]}},
    {"stream": {"rule": [{"id": "", "select": {"class": "Linear"}, "kind": "linear"}]}},
    {"quant": {"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "convrot_int8", "group_size": 16.0}]}},
    {"quant": {"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "int8", "group_size": 16}]}},
    {"quant": {"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "int8", "gguf_type": "Q8_0"}]}},
    {"compile": {"backend": "eager", "mode": "max-autotune"}},
    {"compile": {"blocks": {"no_split": False}}},
    {"policy": {"name": "a..b"}},
], ids=["empty-select", "empty-id", "float-group-size", "group-size-without-convrot", "gguf-type-without-gguf",
        "mode-without-inductor", "no-split-false", "dotdot-name"])
def test_the_crafted_policies_validation_refuses_the_schema_refuses(change):
    document = {"schema_version": 1, "policy": {"name": "p"}, **change}
    assert not toml_validator().is_valid(document)
