"""No input, however malformed, gets anything but clean diagnostics.

Hypothesis mutates the shipped policies (text edits, random bytes, random values under random
keys) and every outcome must be a policy or located diagnostics with known codes that render.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamwise.runtime import check_policy, errors_in, render_json, render_text
from streamwise.runtime.policy.diagnostics import CODES
from streamwise.runtime.policy.folders import SHIPPED_POLICY_DIR
from streamwise.runtime.policy.source import MAX_POLICY_BYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SEEDS = {p.stem: p.read_text(encoding="utf-8") for p in sorted(SHIPPED_POLICY_DIR.glob("*.toml"))}
TOML_ALPHABET = st.sampled_from(
    list('[]{}=",\'.#\n\\ -_ab1') + ["\"\"\"", "'''", "[[", "]]", "é", "\x00", "\t", "true", "1e9"]
)
# STREAMWISE_FUZZ_EXAMPLES=5000 for a deeper local run; CI keeps the suite quick.
FUZZ = settings(
    max_examples=int(os.environ.get("STREAMWISE_FUZZ_EXAMPLES", 120)), deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def assert_clean(data: bytes, stem: str = "fuzzed") -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{stem}.toml"
        path.write_bytes(data)
        policy, diagnostics = check_policy(path)
    lines = data.count(b"\n") + 1
    for diagnostic in diagnostics:
        assert diagnostic.code in CODES
        assert diagnostic.location is not None and 1 <= diagnostic.location.line <= lines
        assert "Input should" not in diagnostic.message and "Extra inputs" not in diagnostic.message
    assert (policy is None) == errors_in(diagnostics)
    render_text(diagnostics)
    json.loads(render_json({stem: diagnostics}))


@st.composite
def edited(draw):
    stem = draw(st.sampled_from(sorted(SEEDS)))
    text = SEEDS[stem]
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, len(text)))
        end = draw(st.integers(start, min(len(text), start + 40)))
        insert = "".join(draw(st.lists(TOML_ALPHABET, max_size=8)))
        text = text[:start] + insert + text[end:]
    return stem, text


@FUZZ
@given(edited())
def test_text_edits(case):
    stem, text = case
    assert_clean(text.encode("utf-8"), stem)


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data):
    assert_clean(data)


TABLES = ["", "[policy]", "[match]", "[stream]", "[[stream.rule]]", "[relocate]", "[[relocate.rule]]",
          "[quant]", "[[quant.rule]]", "[compile]", "[compile.blocks]", "[stream.exclude]"]
KEYS = ["schema_version", "name", "extends", "description", "id", "kind", "select", "format", "group_size",
        "class", "path", "regex", "subclasses", "optional", "mode", "backend", "blocks", "rule", "exclude",
        "dynamo_cache_size_limit", "classes", "state_dict_keys", "zzz"]
SCALARS = st.one_of(
    st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["linear", "convrot_int8", "**", "a..b", "(", "decoder-llm", "default"]),
    st.sampled_from([-1, 0, 3, 16, 70_000]),  # around the bounds of group sizes and cache limits
    st.datetimes(max_value=datetime.datetime(9999, 1, 1)),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)), max_leaves=8)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return "inf" if value == float("inf") else "-inf" if value == float("-inf") else repr(value)
    if isinstance(value, (int, datetime.datetime)):
        return value.isoformat() if isinstance(value, datetime.datetime) else str(value)
    if isinstance(value, str):  # JSON's escapes are TOML's, but for surrogate pairs and a raw DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"


def place(document: dict, table: str, key: str, value) -> None:
    """Set `key = value` in `table` of a parsed policy; an array table gets a new entry copied from its first."""
    target, parts = document, table.strip("[]").split(".") if table else []
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    if parts and table.startswith("[["):
        entries = target[parts[-1]] if isinstance(target.get(parts[-1]), list) else []
        target[parts[-1]] = entries
        target = dict(entries[0]) if entries and isinstance(entries[0], dict) else {}
        entries.append(target)
    elif parts:
        if not isinstance(target.get(parts[-1]), dict):
            target[parts[-1]] = {}
        target = target[parts[-1]]
    target[key] = value


# Keys where they belong, so that half the draws reach each key's own checks rather than `unknown-key`.
PLACES = [("", "schema_version"), ("[policy]", "name"), ("[policy]", "extends"), ("[match]", "classes"),
          ("[match]", "state_dict_keys"), ("[[stream.rule]]", "id"), ("[[stream.rule]]", "kind"),
          ("[[stream.rule]]", "select"), ("[[stream.rule]]", "optional"), ("[stream.exclude]", "path"),
          ("[[relocate.rule]]", "select"), ("[[quant.rule]]", "format"), ("[[quant.rule]]", "group_size"),
          ("[compile]", "mode"), ("[compile]", "backend"), ("[compile]", "dynamo_cache_size_limit"),
          ("[compile.blocks]", "class"), ("[compile.blocks]", "regex")]
PLACE = st.one_of(
    st.sampled_from(PLACES), st.sampled_from(PLACES), st.tuples(st.sampled_from(TABLES), st.sampled_from(KEYS))
)


@FUZZ
@given(st.lists(st.tuples(PLACE, VALUES).map(lambda drawn: (*drawn[0], drawn[1])), min_size=1, max_size=6))
def test_random_values_under_known_and_unknown_keys(entries):
    """Values go into the parsed seed and the document is written out whole, so every example is
    valid TOML and reaches validation (appending `[policy]` again would only test the parser)."""
    document = tomllib.loads(SEEDS["decoder-llm"])
    for table, key, value in entries:
        place(document, table, key, value)
    text = "".join(f"{key} = {toml_value(value)}\n" for key, value in document.items())
    assert tomllib.loads(text) is not None
    assert_clean(text.encode("utf-8"), "decoder-llm")


def codes_for(data: bytes) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "edge.toml"
        path.write_bytes(data)
        return [d.code for d in check_policy(path)[1]]


def test_huge_file_is_refused_before_parsing():
    assert codes_for(b"#" * (MAX_POLICY_BYTES + 1)) == ["file-too-large"]


def test_nesting_deeper_than_the_parser_can_go():
    assert codes_for(b"schema_version = 1\nx = " + b"[" * 100_000 + b"]" * 100_000) == ["invalid-toml"]


def test_deep_but_parseable_nesting_in_a_value():
    header = b'schema_version = 1\n[policy]\nname = "edge"\n[stream]\nexclude = { class = '
    assert codes_for(header + b"[" * 20 + b"]" * 20 + b" }\n") == ["invalid-type"]
    assert codes_for(header + b"[" * 300 + b"]" * 300 + b" }\n") == ["invalid-toml"]


def test_deeply_nested_tables():
    header = b'schema_version = 1\n[policy]\nname = "edge"\n'
    assert codes_for(header + b"[" + b".".join([b"t"] * 10) + b"]\n") == ["unknown-key"]
    assert codes_for(header + b"[" + b".".join([b"t"] * 2000) + b"]\n") == ["invalid-toml"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_wrong_encodings(encoding):
    assert codes_for('schema_version = 1\n[policy]\nname = "edge"\n'.encode(encoding)) == ["invalid-encoding"]


def test_bom_and_crlf_are_fine():
    text = 'schema_version = 1\r\n[policy]\r\nname = "edge"\r\n'
    assert codes_for(b"\xef\xbb\xbf" + text.encode()) == []
