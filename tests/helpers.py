"""Shared test helpers (tests/ is on sys.path through pytest's `pythonpath`)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
INVALID = TESTS / "fixtures" / "invalid"
REPO = TESTS.parent


def write_policy(folder: Path, name: str, body: str = "", *, version: int = 1) -> Path:
    """A policy file `name.toml` in `folder` with the required header and `body` after it."""
    path = folder / f"{name}.toml"
    path.write_text(f'schema_version = {version}\n\n[policy]\nname = "{name}"\n{body}', encoding="utf-8")
    return path
