"""Upgrading older policy documents to the current format, one version at a time.

- each migration is a pure `dict -> dict` step from version N to N+1, registered with `@migration(N)`, so steps
  chain: a file of any readable version passes through every later step;
- each step reports the keys it moved, so the loader warns about every one, located and ruff-style
  (`'stream.classes' -> 'stream.rule'`);
- version 1 is the first format, so the chain is empty today: the hook exists so that the first format change is
  a registration, not a rewrite.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from ...schemas import SCHEMA_VERSION
from ..registry import Registry
from .spans import KeyPath


@dataclass(frozen=True)
class KeyMove:
    """One deprecated key: where it was, where it lives now (None when dropped), and why."""

    old: KeyPath
    new: KeyPath | None
    note: str = ""


Migration = Callable[[dict], "tuple[dict, list[KeyMove]]"]
#: The step that turns a document of schema_version N (the key) into an N + 1 one.
_MIGRATIONS: Registry[Migration] = Registry("migration from schema_version")


def migration(from_version: int) -> Callable[[Migration], Migration]:
    """Register the step that turns a `from_version` document into a `from_version + 1` one."""
    return _MIGRATIONS.decorator(from_version)


def oldest_readable_version() -> int:
    version = SCHEMA_VERSION
    while version - 1 in _MIGRATIONS:
        version -= 1
    return version


def migrate(document: dict, version: int) -> tuple[dict, list[KeyMove]]:
    """Bring a document of a readable `version` up to the current one."""
    moves: list[KeyMove] = []
    if version < SCHEMA_VERSION:
        document = copy.deepcopy(document)
    while version < SCHEMA_VERSION:
        document, step_moves = _MIGRATIONS[version](document)
        moves += step_moves
        version += 1
        document["schema_version"] = version
    return document, moves
