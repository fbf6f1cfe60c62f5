from __future__ import annotations

import pytest

from helpers import TESTS


@pytest.fixture(autouse=True)
def no_user_policy_path(monkeypatch):
    """Tests see only the policies they set up, never the developer's own folder."""
    monkeypatch.delenv("STREAMWISE_POLICY_PATH", raising=False)


@pytest.fixture
def in_tests_dir(monkeypatch):
    """Run from tests/ so diagnostics show short, machine-independent paths."""
    monkeypatch.chdir(TESTS)
    return TESTS
