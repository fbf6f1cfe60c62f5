"""Where policies live and how a policy *name* becomes a file.

Invariants:
- names resolve only inside the policy folders: a name is a plain file stem (`schemas.patterns.is_policy_name`)
  and the file it finds must really lie inside its folder, so neither a crafted name nor a symlink reaches elsewhere;
- folders are searched in order: those a caller adds (ComfyUI's user folder), then `$STREAMWISE_POLICY_PATH`,
  then the shipped `policies/`, so a user's edited copy of a shipped policy wins over the original;
- a name longer than `MAX_NAME_CHARS`, and a path longer than `MAX_PATH_CHARS` or holding a NUL, is refused before
  any filesystem call (which would raise `OSError: File name too long` or `ValueError: embedded null byte`);
- a picker (a ComfyUI node) takes only the names it offers, never a path: `unknown_choice`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ...schemas.patterns import is_policy_name
from .diagnostics import Diagnostic, clip, did_you_mean

SHIPPED_POLICY_DIR = Path(__file__).resolve().parents[2] / "policies"
USER_POLICY_PATH_ENV = "STREAMWISE_POLICY_PATH"
MAX_NAME_CHARS = 128  # a file stem: filesystems allow 255 bytes, `.toml` and UTF-8 included
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def _findable(name: str) -> bool:
    """A policy name that can stand for a file: `x.toml` would be read as a path, so it names none."""
    return len(name) <= MAX_NAME_CHARS and is_policy_name(name) and not name.endswith(".toml")


def name_problem(name: str) -> str | None:
    """Why `name` can stand for no policy file, when it is too long to (the policy name pattern says the rest)."""
    if len(name) <= MAX_NAME_CHARS:
        return None
    return f"is {len(name)} characters long; policy names are at most {MAX_NAME_CHARS}"


def path_problem(path: str) -> str | None:
    """Why `path` cannot name a file, found without touching the filesystem, or None."""
    if "\0" in path:
        return "the path holds a NUL character"
    if len(path) > MAX_PATH_CHARS or any(len(part.encode("utf-8", "replace")) > 255 for part in Path(path).parts):
        return f"the path is too long ({len(path)} characters; a path is at most {MAX_PATH_CHARS}, a name 255 bytes)"
    return None


def unknown_choice(name: object, dirs: Iterable[Path], *, auto: bool = False) -> Diagnostic | None:
    """None when `name` is one of the policies a picker over `dirs` offers (or `auto`, where it is offered), else
    why not: a picker's value is a name, never a path, so a crafted value reads no file."""
    names = (["auto"] if auto else []) + list(list_policies(dirs))
    if isinstance(name, str) and name in names:
        return None
    shown = clip(name if isinstance(name, str) else repr(name), 80)
    return Diagnostic(
        "unknown-policy", f"`{shown}` is not one of the policies offered (a policy name, never a path)",
        suggestion=did_you_mean(name, names), allowed=tuple(names),
        help="pick a shipped policy or one of yours from the list",
    )


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
    """The `*.toml` regular files of one policy folder (a FIFO or device named so would block a read), without
    symlinks that lead out of it."""
    if not folder.is_dir():
        return []
    return [f for f in sorted(folder.glob("*.toml")) if f.is_file() and _inside(f, folder)]


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
