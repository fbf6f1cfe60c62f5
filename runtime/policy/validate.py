"""Turning a parsed document into a `Policy`, with every problem as a located diagnostic.

- pydantic finds the structural problems; each is rewritten in the user's terms (no pydantic wording reaches a
  user: the diagnostics corpus checks it) and pointed at the key or value in the file;
- the checks that span several rules are added here: duplicate ids, a name that disagrees with the file name, and
  rules that select the same modules by the same entry but disagree (no precedence could choose between them).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
from collections.abc import Iterator
from itertools import combinations
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ...schemas import Policy, QuantRule, Selector, StreamRule
from ...schemas.vocabulary import KNOWN_COMPILE_BACKENDS
from .diagnostics import Diagnostic, Note, did_you_mean, format_key_path
from .source import PolicySource
from .spans import KeyPath

_EXPECTED = {
    "string_type": "a string",
    "bool_type": "a boolean (`true` or `false`)",
    "int_type": "an integer",
    "float_type": "a number",
    "tuple_type": "an array",
    "list_type": "an array",
    "model_type": "a table",
    "model_attributes_type": "a table",
    "dict_type": "a table",
}
_LIMITS = {"greater_than_equal": ("ge", "at least"), "less_than_equal": ("le", "at most")}
_STRING_LISTS = {"class", "path", "regex", "classes", "state_dict_keys"}  # a lone string is accepted too
_QUOTED = re.compile(r"'([^']*)'")


def validate_document(source: PolicySource, document: dict) -> tuple[Policy | None, list[Diagnostic]]:
    """Validate a (migrated) document; return the policy, or None and why not."""
    file_problems = _check_file_rules(source, document)  # on the raw document: found beside type errors too
    try:
        policy = Policy.model_validate(document)
    except ValidationError as exc:
        problems = [*(_translate(source, error) for error in exc.errors(include_url=False)), *file_problems]
        return None, sorted(problems, key=lambda d: (d.location.line, d.location.col) if d.location else (0, 0))
    except RecursionError:
        return None, [Diagnostic("invalid-value", "policy is nested too deeply", source.location(1, 1))]
    policy._source = source.file
    for section in Policy.RULE_SECTIONS:
        for index, rule in enumerate(getattr(policy, section).rule):
            rule._origin = (source, (section, "rule", index))
    return policy, file_problems


# pydantic -> diagnostics ----------------------------------------------------------------------
def _translate(source: PolicySource, error: dict) -> Diagnostic:
    loc: KeyPath = tuple(error["loc"])
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    key_path = format_key_path(loc)
    where = _where(loc[:-1])
    name = _name(loc)

    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        return Diagnostic(
            "unknown-key", f"unknown key {name} {where}", source.locate(loc), key_path=key_path,
            suggestion=did_you_mean(loc[-1], allowed), allowed=allowed,
        )
    if kind == "missing":
        return Diagnostic(
            "missing-key", f"missing required key {name} {where}", source.locate(loc[:-1]), key_path=key_path
        )
    if kind == "literal_error":
        allowed = tuple(_QUOTED.findall(ctx.get("expected", "")))
        return Diagnostic(
            "invalid-value", f"{name} must be one of the allowed values, found {_show(value)}",
            source.locate(loc, value=True), key_path=key_path, suggestion=did_you_mean(value, allowed), allowed=allowed,
        )
    if kind in _EXPECTED:
        expected = "a string or an array of strings" if loc[-1] in _STRING_LISTS else _EXPECTED[kind]
        return Diagnostic(
            "invalid-type", f"{name} must be {expected}, found {_describe(value)}",
            source.locate(loc, value=True), key_path=key_path,
        )
    if kind in _LIMITS:
        bound, words = _LIMITS[kind]
        return Diagnostic(
            "invalid-value", f"{name} must be {words} {ctx.get(bound)}, found {_show(value)}",
            source.locate(loc, value=True), key_path=key_path,
        )
    if "-" in kind:  # our own PydanticCustomError codes: the message is already ours
        if "field" in ctx:
            loc = loc + (ctx["field"],)
        location = _with_offset(source, loc, ctx.get("offset"))
        return Diagnostic(kind, error["msg"], location, key_path=format_key_path(loc))
    return Diagnostic(
        "invalid-value", f"{name} has an invalid value {_show(value)}", source.locate(loc, value=True),
        key_path=key_path,
    )


def _with_offset(source: PolicySource, loc: KeyPath, offset: int | None):
    """Point inside a string value at the character a pattern error names."""
    location = source.locate(loc, value=True)
    raw = location.source_line[location.col - 1 : location.end_col - 1]
    if offset is None or len(raw) < 2 or raw[0] not in "\"'" or (raw[0] == '"' and "\\" in raw):
        return location
    col = min(location.col + 1 + offset, location.end_col - 2)
    return dataclasses.replace(location, col=col, end_col=col + 1)


def _name(loc: KeyPath) -> str:
    if not loc:
        return "the document"
    if isinstance(loc[-1], str):
        return f"`{loc[-1]}`"
    return f"item {loc[-1]} of `{format_key_path(loc[:-1])}`"


def _where(table: KeyPath) -> str:
    return f"in [{format_key_path(table)}]" if table else "at the top level"


def _describe(value: Any) -> str:
    noun = (
        "a boolean" if isinstance(value, bool)
        else "an integer" if isinstance(value, int)
        else "a float" if isinstance(value, float)
        else "a string" if isinstance(value, str)
        else "an array" if isinstance(value, (list, tuple))
        else "a table" if isinstance(value, dict)
        else "a date/time" if isinstance(value, (datetime.date, datetime.time))
        else type(value).__name__
    )
    return noun if isinstance(value, (list, tuple, dict)) else f"{noun} {_show(value)}"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = '"' + value + '"'
    elif isinstance(value, (list, tuple, dict)):
        return "an array" if isinstance(value, (list, tuple)) else "a table"
    else:
        text = str(value)
    return f"`{text if len(text) <= 60 else text[:57] + '...'}`"


def _allowed_keys(loc: KeyPath) -> tuple[str, ...]:
    model = _model_at(loc)
    if model is None:
        return ()
    return tuple(field.alias or name for name, field in model.model_fields.items())


def _model_at(loc: KeyPath) -> type[BaseModel] | None:
    current: Any = Policy
    for part in loc:
        current = _strip(current)
        if isinstance(part, int):
            if get_origin(current) is not tuple:
                return None
            current = get_args(current)[0]
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = next((f for n, f in current.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        current = field.annotation
    current = _strip(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _strip(annotation: Any) -> Any:
    """Look through Annotated and Optional to the type that holds the keys."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [a for a in get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


# checks across rules --------------------------------------------------------------------------
def _check_file_rules(source: PolicySource, document: dict) -> list[Diagnostic]:
    """Checks that need no valid policy: the name, rule ids and the backend, read where they are well typed."""
    problems: list[Diagnostic] = []
    stem = source.file.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".toml")
    name = _table(document, "policy").get("name")
    if isinstance(name, str) and name != stem:
        problems.append(Diagnostic(
            "name-mismatch",
            f"policy name `{name}` differs from its file name `{stem}`; "
            "`extends` and the policy pickers find policies by file name",
            source.locate(("policy", "name"), value=True), key_path="policy.name", suggestion=stem,
        ))
    for section in Policy.RULE_SECTIONS:
        rules = _table(document, section).get("rule")
        seen: dict[str, int] = {}
        for index, rule in enumerate(rules if isinstance(rules, list) else ()):
            rule_id = rule.get("id") if isinstance(rule, dict) else None
            if not isinstance(rule_id, str):
                continue
            if rule_id in seen:
                first = source.locate((section, "rule", seen[rule_id], "id"), value=True)
                problems.append(Diagnostic(
                    "duplicate-id", f"rule id `{rule_id}` is used twice in [{section}]",
                    source.locate((section, "rule", index, "id"), value=True), key_path=f"{section}.rule[{index}].id",
                    notes=(Note("first used here", first),), help="give every rule of a section its own id",
                ))
            seen.setdefault(rule_id, index)
    backend = _table(document, "compile").get("backend")
    if isinstance(backend, str) and backend not in KNOWN_COMPILE_BACKENDS:
        problems.append(Diagnostic(
            "unknown-backend",
            f"`{backend}` is not a backend torch ships; it must be registered when compiling",
            source.locate(("compile", "backend"), value=True), severity="warning", key_path="compile.backend",
            suggestion=did_you_mean(backend, KNOWN_COMPILE_BACKENDS), allowed=KNOWN_COMPILE_BACKENDS,
        ))
    return problems


def _table(document: object, key: str) -> dict:
    value = document.get(key) if isinstance(document, dict) else None
    return value if isinstance(value, dict) else {}


def check_rule_conflicts(policy: Policy) -> list[Diagnostic]:
    """Rules that select the very same modules by the very same entry but disagree.

    Such rules are equally specific for every module they select, so no precedence can pick one.
    Overlaps between different entries (a class and a path) are settled by precedence when the
    policy is resolved against a model.
    """
    rules = [(section, rule) for section in Policy.RULE_SECTIONS for rule in getattr(policy, section).rule]
    holders: dict[tuple, list[int]] = {}  # entry -> the rules that have it: only they can conflict over it
    for index, (_, rule) in enumerate(rules):
        for entry in set(_entries(rule.select)):
            holders.setdefault(entry, []).append(index)
    pairs = sorted({pair for indices in holders.values() for pair in combinations(indices, 2)})
    problems = []
    for first, second in pairs:
        (section_a, a), (section_b, b) = rules[first], rules[second]
        disagreement = _disagreement(section_a, a, section_b, b)
        if disagreement is None:
            continue
        for entry in _entries(a.select):
            if entry in set(_entries(b.select)):
                problems.append(Diagnostic(
                    "rule-conflict",
                    f"rules `{a.id}` and `{b.id}` both select {entry[0]} `{entry[1]}` but {disagreement}",
                    _entry_location(b, entry), key_path=_rule_key(b),
                    notes=(Note(f"`{a.id}` selects it here", _entry_location(a, entry)),),
                    help="keep one of the two, or make one of them more specific",
                ))
                break
    return problems


def _disagreement(section_a: str, a: Any, section_b: str, b: Any) -> str | None:
    if section_a != section_b:
        pair = {section_a, section_b}
        return "a module cannot both stream and relocate" if pair == {"stream", "relocate"} else None
    if a.decision == b.decision:
        return None
    if isinstance(a, StreamRule):
        return f"disagree on the compute kind (`{a.kind}` vs `{b.kind}`)"
    return f"disagree on the quant format (`{_quant_label(a)}` vs `{_quant_label(b)}`)"


def _quant_label(rule: QuantRule) -> str:
    size = rule.effective_group_size
    return rule.format if size is None else f"{rule.format}, group_size {size}"


def _entries(selector: Selector) -> Iterator[tuple[str, str]]:
    """Each entry as (what it selects by, text); subclass matching makes a class entry different."""
    class_kind = "class or subclass" if selector.subclasses else "class"
    yield from ((class_kind, name) for name in selector.class_)
    yield from (("path", glob) for glob in selector.path)
    yield from (("regex", regex) for regex in selector.regex)
    if selector.holds:
        yield "holds", selector.holds


def _entry_location(rule: Any, entry: tuple[str, str]):
    source, path = rule._origin
    field = "class" if entry[0].startswith("class") else entry[0]
    if field == "holds":
        return source.locate(path + ("select", field), value=True)
    index = list(getattr(rule.select, "class_" if field == "class" else field)).index(entry[1])
    return source.locate(path + ("select", field, index), value=True)


def _rule_key(rule: Any) -> str:
    return format_key_path(rule._origin[1])
