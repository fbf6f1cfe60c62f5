"""Every broken policy in tests/fixtures/invalid renders reviewed diagnostics, as text and JSON.

A fixture's file name starts with the code it must produce (`<code>--<detail>.toml`).
"""

from __future__ import annotations

import json
import re

import pytest

from streamwise.runtime import check_policy, errors_in, render_json, render_text

from helpers import INVALID

CASES = sorted(p.name for p in INVALID.glob("*.toml"))
PYDANTIC_WORDING = re.compile(r"Input should|Extra inputs|Field required|validation error|pydantic|type=", re.I)


def diagnose(name):
    policy, diagnostics = check_policy(INVALID.relative_to(INVALID.parent.parent) / name)
    return policy, diagnostics


def test_corpus_is_large_and_covers_every_code():
    codes = {name.split("--")[0].removesuffix(".toml") for name in CASES}
    assert len(CASES) >= 25
    assert {
        "invalid-toml", "invalid-encoding", "unknown-key", "missing-key", "invalid-type", "invalid-value",
        "bad-regex", "bad-glob", "empty-selector", "duplicate-id", "rule-conflict", "extends-cycle",
        "unknown-extends", "invalid-extends", "unsupported-version", "name-mismatch", "unknown-backend",
    } <= codes


@pytest.mark.parametrize("name", CASES)
def test_text(name, in_tests_dir, snapshot):
    policy, diagnostics = diagnose(name)
    expected_code = name.split("--")[0].removesuffix(".toml")
    assert expected_code in {d.code for d in diagnostics}
    if not errors_in(diagnostics):
        assert policy is not None  # warnings alone never stop a policy
    else:
        assert policy is None
    text = render_text(diagnostics)
    assert not PYDANTIC_WORDING.search(text)
    for diagnostic in diagnostics:
        assert diagnostic.location is not None and diagnostic.location.line >= 1
    assert text == snapshot


@pytest.mark.parametrize("name", CASES)
def test_json(name, in_tests_dir, snapshot):
    _, diagnostics = diagnose(name)
    rendered = render_json({f"fixtures/invalid/{name}": diagnostics})
    document = json.loads(rendered)
    assert document["summary"]["errors"] == sum(d.is_error for d in diagnostics)
    keys = {"code", "severity", "message", "file", "line", "col"}
    assert all(set(d) >= keys for d in document["files"][0]["diagnostics"])
    assert rendered == snapshot
