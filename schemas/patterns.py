"""Syntax of policy names and of the selector entry kinds: class names (and class globs), path globs and regexes.

A policy name (also an `extends` target or a rule id) is a file stem, `POLICY_NAME` without `..`, so a name
never reaches outside a policy folder.

Path globs work on dotted module paths segment by segment and always match the whole path, so `kv_proj` never
hits `qkv_proj` and `layers.*` never reaches `model.layers.0`:

- `*` matches exactly one segment, `**` zero or more segments;
- `?` and `[...]` (`[!...]` negates) match characters inside one segment;
- the empty glob `""` matches the root module.
"""

from __future__ import annotations

import re

#: Policy names, `extends` targets and rule ids: a file stem, never a path (`is_policy_name` also refuses `..`).
POLICY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_SEGMENT_CHAR_CLASS = re.compile(r"\[(!?)(\]?[^\]]*)\]")


class PatternError(ValueError):
    """A selector entry that does not compile; `offset` is the index of the faulty character, if one is."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


def is_policy_name(text: str) -> bool:
    """Whether `text` is a `POLICY_NAME` without `..`: a name that can only stand for a file inside its folder."""
    return POLICY_NAME.fullmatch(text) is not None and ".." not in text


def check_class_name(name: str) -> None:
    """A class entry: `Name`, `package.module.Name`, or a glob of either (`*RMSNorm`, `transformers.**.*Norm`)."""
    if not _CLASS_NAME.fullmatch(name.replace("*", "_").replace("?", "_")):
        bad = next((i for i, ch in enumerate(name) if not (ch.isalnum() or ch in "_.*?")), None)
        raise PatternError(
            f"`{name}` is not a class name: use `Name` or `package.module.Name` (`*` and `?` make a glob)", bad
        )
    if is_class_glob(name):
        compile_glob(name)


def is_class_glob(name: str) -> bool:
    """Whether a class entry is a glob: matched like a path glob against the short name, or against the
    qualified name when it has a `.`."""
    return "*" in name or "?" in name


def compile_glob(glob: str) -> re.Pattern[str]:
    """Translate a path glob into a regex over `"." + path` (the root is the empty path)."""
    if glob == "":
        return re.compile("")
    parts: list[str] = []
    offset = 0
    for segment in glob.split("."):
        if segment == "":
            raise PatternError(f"empty segment in path glob `{glob}` (stray `.`)", offset)
        if segment == "**":
            parts.append(r"(?:\.[^.]+)*")
        elif "**" in segment:
            raise PatternError(
                f"`**` must be a whole segment in `{glob}` (write `a.**.b`, not `a**`)",
                offset + segment.index("**"),
            )
        else:
            parts.append(r"\." + _translate_segment(segment, offset))
        offset += len(segment) + 1
    return re.compile("".join(parts))


def _translate_segment(segment: str, offset: int) -> str:
    out: list[str] = []
    i = 0
    while i < len(segment):
        ch = segment[i]
        if ch == "*":
            out.append(r"[^.]*")
        elif ch == "?":
            out.append(r"[^.]")
        elif ch == "[":
            found = _SEGMENT_CHAR_CLASS.match(segment, i)
            if not found or not found.group(2):
                raise PatternError(f"unclosed or empty `[` in path glob segment `{segment}`", offset + i)
            negate, body = found.groups()
            body = body.replace("\\", r"\\").replace("^", r"\^").replace("]", r"\]").replace("[", r"\[")
            char_class = f"[{'^.' if negate else ''}{body}]"
            try:
                re.compile(char_class)
            except re.error as exc:  # a reversed range such as `[z-a]`
                raise PatternError(f"invalid `[...]` in path glob segment `{segment}`: {exc.msg}", offset + i) from None
            out.append(char_class)
            i = found.end()
            continue
        elif ch == "]":
            raise PatternError(f"unmatched `]` in path glob segment `{segment}`", offset + i)
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def glob_matches(pattern: re.Pattern[str], path: str) -> bool:
    return pattern.fullmatch("." + path if path else "") is not None


def glob_literal_segments(glob: str) -> int:
    """How many segments of a glob are plain text: the tie-breaker between two globs."""
    return sum(1 for s in glob.split(".") if s and not any(c in s for c in "*?["))


def is_exact_path(glob: str) -> bool:
    return not any(c in glob for c in "*?[")


def compile_regex(source: str) -> re.Pattern[str]:
    try:
        return re.compile(source)
    except re.error as exc:
        raise PatternError(f"invalid regex `{source}`: {exc.msg}", exc.pos) from None
    except RecursionError:
        raise PatternError(f"regex `{source}` is nested too deeply") from None
    except OverflowError as exc:  # a repeat count beyond what `re` can hold
        raise PatternError(f"invalid regex `{source}`: {exc}") from None
