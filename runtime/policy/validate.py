"""Turning a parsed document into a `Policy`, with every problem as a located diagnostic.

- pydantic finds the structural problems; each is rewritten in the user's terms (no pydantic wording reaches a
  user: the diagnostics corpus checks it) and pointed at the key or value in the file;
- the checks that span several rules are added here: duplicate ids, a name that disagrees with the file name, and
  rules that select the same modules by the same entry but disagree (no precedence could choose between them);
- bounded whatever the document holds: a section over `MAX_RULES_PER_SECTION` rules is refused before pydantic
  runs, at most `MAX_DIAGNOSTICS` problems are translated, and conflicts are found per entry, in time linear in
  the rules (one diagnostic per entry names the first rule and up to `_MAX_RIVALS_NAMED` rivals).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
from collections.abc import Iterator
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ...schemas import Policy, QuantRule, Selector, StreamRule
from ...schemas.vocabulary import KNOWN_COMPILE_BACKENDS
from .diagnostics import MAX_DIAGNOSTICS, Diagnostic, Note, capped, clip, did_you_mean, format_key_path
from .limits import MAX_RULES_PER_SECTION
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
_MAX_SHOWN = 60  # characters of a value quoted in a message
_MAX_RIVALS_NAMED = 5


def validate_document(source: PolicySource, document: dict) -> tuple[Policy | None, list[Diagnostic]]:
    """Validate a (migrated) document; return the policy, or None and why not."""
    too_many = _too_many_rules(source, document)
    if too_many:
        return None, too_many
    file_problems = _check_file_rules(source, document)  # on the raw document: found beside type errors too
    try:
        policy = Policy.model_validate(document)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        problems = [*(_translate(source, error) for error in errors[:MAX_DIAGNOSTICS]), *file_problems]
        problems.sort(key=lambda d: (d.location.line, d.location.col) if d.location else (0, 0))
        return None, capped(problems, len(errors) + len(file_problems))
    except RecursionError:
        return None, [Diagnostic("invalid-value", "policy is nested too deeply", source.location(1, 1))]
    policy._source = source.file
    for section in Policy.RULE_SECTIONS:
        for index, rule in enumerate(getattr(policy, section).rule):
            rule._origin = (source, (section, "rule", index))
    return policy, capped(file_problems)


def _too_many_rules(source: PolicySource, document: dict) -> list[Diagnostic]:
    """A section with more rules than `MAX_RULES_PER_SECTION`, located at the first rule over the limit."""
    return [
        Diagnostic(
            "invalid-value", f"[{section}] has {len(rules)} rules; the limit is {MAX_RULES_PER_SECTION}",
            source.locate((section, "rule", MAX_RULES_PER_SECTION)), key_path=f"{section}.rule",
        )
        for section in Policy.RULE_SECTIONS
        if isinstance(rules := _table(document, section).get("rule"), list) and len(rules) > MAX_RULES_PER_SECTION
    ]


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
        return Diagnostic(kind, clip(error["msg"]), location, key_path=format_key_path(loc))
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
        return f"`{clip(loc[-1], _MAX_SHOWN)}`"
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
    if isinstance(value, (list, tuple, dict)):
        return noun
    shown = _show(value)
    return f"{noun} {shown}" if shown.startswith("`") else shown


def _show(value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = '"' + value + '"'
    elif isinstance(value, (list, tuple, dict)):
        return "an array" if isinstance(value, (list, tuple)) else "a table"
    elif isinstance(value, int) and value.bit_length() > 4 * _MAX_SHOWN:  # never `str` a huge integer
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    else:
        text = str(value)
    return f"`{text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + '...'}`"


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
    policy is resolved against a model. Each entry is looked at once: its first rule of a section against the
    others that hold it, so the work is linear in the rules, however many share an entry.
    """
    rules = [(section, rule) for section in Policy.RULE_SECTIONS for rule in getattr(policy, section).rule]
    holders: dict[tuple, list[int]] = {}  # entry -> the rules that have it: only they can conflict over it
    for index, (_, rule) in enumerate(rules):
        for entry in dict.fromkeys(_entries(rule.select)):
            holders.setdefault(entry, []).append(index)
    found: dict[tuple[int, int], Diagnostic] = {}  # by (first rule, first rival): one report per pair
    for entry, indices in holders.items():
        for first, rivals in _rivals(rules, indices):
            if (first, rivals[0]) not in found:
                found[first, rivals[0]] = _conflict(rules, entry, first, rivals)
    return capped([found[pair] for pair in sorted(found)])


def _rivals(rules: list[tuple[str, Any]], indices: list[int]) -> Iterator[tuple[int, list[int]]]:
    """For the rules holding one entry: each section's first rule with the later ones that disagree with it."""
    firsts: dict[str, int] = {}
    for index in indices:
        firsts.setdefault(rules[index][0], index)
    for first in sorted(firsts.values()):
        section, rule = rules[first]
        rivals = [i for i in indices if i > first and _disagreement(section, rule, *rules[i]) is not None]
        if rivals:
            yield first, rivals


def _conflict(rules: list[tuple[str, Any]], entry: tuple[str, str], first: int, rivals: list[int]) -> Diagnostic:
    (section_a, a), (section_b, b) = rules[first], rules[rivals[0]]
    others = [f"`{rules[i][1].id}`" for i in rivals[1 : 1 + _MAX_RIVALS_NAMED]]
    more = len(rivals) - 1 - len(others)
    also = f"; so do {len(rivals) - 1} more rules: {', '.join(others)}" if others else ""
    return Diagnostic(
        "rule-conflict",
        f"rules `{a.id}` and `{b.id}` both select {entry[0]} `{clip(entry[1], _MAX_SHOWN)}` but "
        f"{_disagreement(section_a, a, section_b, b)}{also}" + (f", and {more} more" if more > 0 else ""),
        _entry_location(b, entry), key_path=_rule_key(b),
        notes=(Note(f"`{a.id}` selects it here", _entry_location(a, entry)),),
        help="keep one of the two, or make one of them more specific",
    )


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
