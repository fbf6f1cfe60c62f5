"""The committed JSON Schema is current, flat enough for TOML editors, and used by every policy."""

from __future__ import annotations

import json
import re

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


def test_every_key_is_documented_in_the_template_and_the_readme():
    keys = property_names(build_schema())
    template = (SHIPPED_POLICY_DIR / "_template.toml").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [k for k in sorted(keys) if not re.search(rf"\b{k}\b", template)] == []
    documented = set(re.findall(r"`\[*([a-z_]+)", readme)) | set(re.findall(r"\[\[?[a-z_]+\.([a-z_]+)\]", readme))
    assert sorted(keys - documented) == []
