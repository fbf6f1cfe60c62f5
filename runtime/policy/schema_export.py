"""Generate the JSON Schema that editors use to check policy files as they are typed.

- flat (every `$ref` inlined, no `$defs`, no `allOf`, no `null`): TOML language servers such as
  taplo/Even Better TOML stumble over references, and TOML has no null;
- generated from the pydantic models only: each check a validator makes is stated beside it as schema keywords
  (patterns, a selector's one entry, `dependencies`, `if`/`then`), and `tests/policy/test_schema.py` draws documents and
  holds the schema and the validators to the same answer; RE2 validity and TOML's integer type are the two things a
  schema cannot say (a TOML float 16.0 is the number 16 to it);
- each field described by the docstring under it (`schemas.field_docs`);
- committed under `schemas/`, and a test fails when it is stale. Regenerate with:

    python -m streamwise.runtime.policy.schema_export
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ...schemas import SCHEMA_VERSION, Policy
from ...schemas.field_docs import field_descriptions

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / f"policy.v{SCHEMA_VERSION}.schema.json"


def build_schema() -> dict[str, Any]:
    raw = Policy.model_json_schema(by_alias=True)
    definitions = raw.pop("$defs", {})
    for model in _models(Policy):
        _describe(raw if model is Policy else definitions[model.__name__], model)
    schema = _inline(raw, definitions)
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$id": f"https://streamwise.dev/schemas/policy.v{SCHEMA_VERSION}.schema.json",
        **schema,
        "title": "Streamwise policy",
    }


def render_schema() -> str:
    return json.dumps(build_schema(), indent=2, sort_keys=False) + "\n"


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = definitions[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**_inline(target, definitions), **{k: v for k, v in node.items() if k != "$ref"}}
            return _inline(merged, definitions)
        node = _drop_null(node)
        return {key: _inline(value, definitions) for key, value in node.items() if not _dropped(key, value)}
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    return node


def _dropped(key: str, value: Any) -> bool:
    """Pydantic's generated titles, and defaults that are None (TOML has no null) or a whole table."""
    if key == "title":
        return isinstance(value, str)
    return key == "default" and (value is None or isinstance(value, dict))


def _models(root: type[BaseModel]) -> list[type[BaseModel]]:
    """`root` and every model its fields hold, each once."""
    found, pending = [], [root]
    while pending:
        model = pending.pop()
        if model in found:
            continue
        found.append(model)
        for field in model.model_fields.values():
            pending.extend(_nested_models(field.annotation))
    return found


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in getattr(annotation, "__args__", ()) for model in _nested_models(argument)]


def _describe(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Each property of `model`'s schema described by its field's docstring, as pydantic's own descriptions are."""
    for name, description in field_descriptions(model).items():
        field = model.model_fields[name]
        if field.description is None:
            key = field.alias or name  # pydantic's schemas keep each property's keywords sorted
            schema["properties"][key] = dict(sorted({**schema["properties"][key], "description": description}.items()))


def _drop_null(node: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: an optional table is simply absent, so `anyOf [X, null]` becomes X."""
    branches = node.get("anyOf")
    if not branches or {"type": "null"} not in branches:
        return node
    rest = [b for b in branches if b != {"type": "null"}]
    node = {k: v for k, v in node.items() if k != "anyOf"}
    return {**rest[0], **node} if len(rest) == 1 else {**node, "anyOf": rest}


def main() -> None:
    SCHEMA_PATH.write_text(render_schema(), encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}")


if __name__ == "__main__":
    main()
