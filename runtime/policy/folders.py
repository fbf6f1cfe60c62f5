"""Where policies live and how a policy *name* becomes a file.

Invariants:
- names resolve only inside the policy folders: a name is a plain file stem (`schemas.patterns.is_policy_name`)
  and the file it finds must really lie inside its folder, so neither a crafted name nor a symlink reaches elsewhere;
- folders are searched in order: those a caller adds (ComfyUI's user folder), then `$STREAMWISE_POLICY_PATH`,
  then the shipped `policies/`, so a user's edited copy of a shipped policy wins over the original.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ...schemas.patterns import is_policy_name

SHIPPED_POLICY_DIR = Path(__file__).resolve().parents[2] / "policies"
USER_POLICY_PATH_ENV = "STREAMWISE_POLICY_PATH"


def _findable(name: str) -> bool:
    """A policy name that can stand for a file: `x.toml` would be read as a path, so it names none."""
    return is_policy_name(name) and not name.endswith(".toml")


def policy_dirs(extra: Iterable[str | os.PathLike] = ()) -> list[Path]:
    user = [p for p in os.environ.get(USER_POLICY_PATH_ENV, "").split(os.pathsep) if p]
    dirs: list[Path] = []
    for folder in [*extra, *user, SHIPPED_POLICY_DIR]:
        path = Path(folder)
        if path not in dirs:
            dirs.append(path)
    return dirs


def find_policy(name: str, dirs: Iterable[Path]) -> Path | None:
    """The file a policy name stands for in the first folder that has it, or None."""
    if not _findable(name):
        return None
    for folder in dirs:
        candidate = folder / f"{name}.toml"
        if candidate.is_file() and _inside(candidate, folder):
            return candidate
    return None


def policy_files(folder: Path) -> list[Path]:
    """The `*.toml` files of one policy folder, without symlinks that lead out of it."""
    return [f for f in sorted(folder.glob("*.toml")) if _inside(f, folder)] if folder.is_dir() else []


def list_policies(dirs: Iterable[Path], *, include_hidden: bool = False) -> dict[str, Path]:
    """Every policy by name, earlier folders shadowing later ones; `_`-prefixed files are hidden."""
    found: dict[str, Path] = {}
    for folder in dirs:
        for candidate in policy_files(folder):
            name = candidate.stem
            if name in found or not _findable(name):
                continue
            if include_hidden or not name.startswith("_"):
                found[name] = candidate
    return dict(sorted(found.items()))


def _inside(candidate: Path, folder: Path) -> bool:
    try:
        return candidate.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, before Python 3.13
        return False
