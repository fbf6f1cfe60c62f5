"""`load_policy`: from a name or a file to a validated, fully inherited `Policy`.

The stages run in order, and each reports every problem it finds:
- `source`: read the file and parse the TOML, keeping where each key is;
- `migrations`: check `schema_version` and upgrade an older document;
- `validate`: check the document against the pydantic models;
- `extends`: load the parents the same way and merge them;
- `validate` again: check that no two rules of the merged policy conflict.

Nothing here imports torch or any module a policy names: a policy is data (a test proves it in a fresh interpreter).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ...schemas import SCHEMA_VERSION, Policy
from .diagnostics import Diagnostic, Location, Note, PolicyError, clip, did_you_mean, errors_in, format_key_path
from .extends import merge_chain
from .folders import find_policy, list_policies, name_problem, policy_dirs
from .limits import MAX_EXTENDS_CHAIN
from .migrations import migrate, oldest_readable_version
from .source import PolicySource, display_path, read_source
from .validate import check_rule_conflicts, validate_document


def load_policy(name_or_path: str | os.PathLike[str], *, dirs: Iterable[str | os.PathLike] = ()) -> Policy:
    """Load a shipped or user policy by name, or a policy file by path, with `extends` resolved.

    Raises `PolicyError` carrying every located diagnostic when the policy has errors.
    """
    policy, diagnostics = check_policy(name_or_path, dirs=dirs)
    if policy is None:
        raise PolicyError(diagnostics)
    return policy


def as_policy(policy: Policy | str | os.PathLike[str], *, dirs: Iterable[str | os.PathLike] = ()) -> Policy:
    """`policy` itself, or the policy a name or path stands for (`load_policy`): what every API taking one accepts."""
    return policy if isinstance(policy, Policy) else load_policy(policy, dirs=dirs)


def check_policy(
    name_or_path: str | os.PathLike[str], *, dirs: Iterable[str | os.PathLike] = ()
) -> tuple[Policy | None, list[Diagnostic]]:
    """Like `load_policy`, but return the diagnostics (warnings too) instead of raising."""
    search = policy_dirs(dirs)
    path = _as_path(name_or_path, search)
    if isinstance(path, Diagnostic):
        return None, [path]
    policy, diagnostics = _load_chain(path, search)
    if policy is not None and not errors_in(diagnostics):
        diagnostics += check_rule_conflicts(policy)
    return (None if errors_in(diagnostics) else policy), diagnostics


def _as_path(name_or_path: str | os.PathLike[str], search: list[Path]) -> Path | Diagnostic:
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or any(sep in text for sep in "/\\") or text.endswith(".toml"):
        return Path(text)
    too_long = name_problem(text)
    if too_long is not None:
        return Diagnostic("unknown-policy", f"`{clip(text, 60)}` cannot be a policy name: it {too_long}")
    found = find_policy(text, search)
    if found is not None:
        return found
    names = tuple(list_policies(search))
    return Diagnostic(
        "unknown-policy", f"no policy named `{text}` in the policy folders",
        suggestion=did_you_mean(text, names), allowed=names,
        help="policy folders: " + ", ".join(str(d) for d in search),
    )


def _load_chain(path: Path, search: list[Path]) -> tuple[Policy | None, list[Diagnostic]]:
    """Load one file and, through `extends`, its ancestors: one file after the other (no recursion), each checked
    against the files below it in a set, at most `MAX_EXTENDS_CHAIN` of them, then merged in one pass."""
    chain: list[tuple[Policy, Location | None]] = []  # loaded so far, the file asked for first; where each extends
    seen: set[Path] = set()
    diagnostics: list[Diagnostic] = []
    while True:
        policy, where, parent_path, problem = _load_link(path, search, diagnostics)
        if problem is None and policy is not None and parent_path is not None:
            problem = _chain_problem(path, parent_path, chain, seen, where)
        if problem is not None:
            diagnostics.append(problem)
        if policy is None or problem is not None:
            break
        chain.append((policy, where))
        seen.add(path.resolve())
        if parent_path is None:
            return merge_chain([p for p, _ in reversed(chain)]), diagnostics
        path = parent_path
    if problem is None or problem.code not in ("extends-cycle", "invalid-extends"):
        diagnostics += [Diagnostic("invalid-extends", f"the policy `{parent.policy.extends}` that this policy extends "
                                   "has errors", where, key_path="policy.extends")
                        for parent, where in reversed(chain)]
    return None, diagnostics


def _load_link(path: Path, search: list[Path], diagnostics: list[Diagnostic]):
    """One file of a chain: (its policy, where its `extends` is, the parent's path, a problem with the `extends`);
    the file's own diagnostics go to `diagnostics`."""
    source, found = read_source(path, display_path(path))
    diagnostics += found
    if source is None:
        return None, None, None, None
    document, found = _upgrade(source)
    diagnostics += found
    if document is None:
        return None, None, None, None
    policy, found = validate_document(source, document)
    diagnostics += found
    if policy is None or policy.policy.extends is None:
        return policy, None, None, None
    where = source.locate(("policy", "extends"), value=True)
    parent_name = policy.policy.extends
    too_long = name_problem(parent_name)
    if too_long is not None:
        return None, where, None, Diagnostic(
            "invalid-value", f"`extends` names no policy file: `{clip(parent_name, 60)}` {too_long}", where,
            key_path="policy.extends",
        )
    parent_path = find_policy(parent_name, [path.parent, *search])
    if parent_path is None:
        names = tuple(n for n in list_policies([path.parent, *search], include_hidden=True) if n != path.stem)
        return None, where, None, Diagnostic(
            "unknown-extends", f"`extends` names `{parent_name}`, which is not a policy in the policy folders",
            where, key_path="policy.extends", suggestion=did_you_mean(parent_name, names),
        )
    return policy, where, parent_path, None


def _chain_problem(path: Path, parent: Path, chain: list, seen: set[Path], where: Location | None):
    """An `extends` that closes a cycle, or makes the chain longer than `MAX_EXTENDS_CHAIN` (blamed on the file
    asked for, whose chain it is: every file in it may be valid on its own)."""
    names = [*(p.policy.name for p, _ in chain), path.stem, parent.stem]
    if parent.resolve() in seen or parent.resolve() == path.resolve():
        notes = tuple(Note("extended from here", w) for _, w in reversed(chain) if w is not None)
        return Diagnostic("extends-cycle", f"`extends` forms a cycle: {' -> '.join(names)}", where,
                          key_path="policy.extends", notes=notes)
    if len(chain) + 2 > MAX_EXTENDS_CHAIN:
        shown = " -> ".join([*names[:3], "...", *names[-2:]])
        return Diagnostic("invalid-extends", f"the `extends` chain {shown} holds more than {MAX_EXTENDS_CHAIN} "
                          f"policies; the limit is {MAX_EXTENDS_CHAIN}", chain[0][1] if chain else where,
                          key_path="policy.extends")
    return None


def _upgrade(source: PolicySource) -> tuple[dict | None, list[Diagnostic]]:
    """Check `schema_version` before anything else, then migrate an older document."""
    document = source.document
    version = document.get("schema_version")
    where = source.locate(("schema_version",), value=True)
    newest, oldest = SCHEMA_VERSION, oldest_readable_version()
    if "schema_version" not in document:
        return None, [Diagnostic(
            "missing-key", "missing required key `schema_version` at the top level", source.location(1, 1),
            key_path="schema_version", help=f"start the file with `schema_version = {newest}`",
        )]
    if type(version) is not int:
        return None, [Diagnostic(
            "invalid-type", "`schema_version` must be an integer", where, key_path="schema_version",
        )]
    if version > newest:
        return None, [Diagnostic(
            "unsupported-version", f"policy requires schema_version {version}; this runtime supports up to {newest}",
            where, key_path="schema_version", help="upgrade streamwise to read this policy",
        )]
    if version < oldest:
        return None, [Diagnostic(
            "unsupported-version", f"schema_version {version} is older than any this runtime reads (oldest: {oldest})",
            where, key_path="schema_version",
        )]
    document, moves = migrate(document, version)
    return document, [
        Diagnostic(
            "deprecated-key",
            f"'{format_key_path(m.old)}' -> '{format_key_path(m.new)}'" if m.new
            else f"'{format_key_path(m.old)}' was removed",
            source.locate(m.old), severity="warning", key_path=format_key_path(m.old), help=m.note or None,
        )
        for m in moves
    ]
