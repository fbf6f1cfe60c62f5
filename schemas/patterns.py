r"""Syntax of policy names and of the selector entry kinds: class names (and class globs), path globs and regexes.

A policy name (also an `extends` target or a rule id) is a file stem, `POLICY_NAME` without `..`, so a name
never reaches outside a policy folder.

Path globs work on dotted module paths segment by segment and always match the whole path, so `kv_proj` never
hits `qkv_proj` and `layers.*` never reaches `model.layers.0`:

- `*` matches exactly one segment, `**` zero or more segments;
- `?` and `[...]` (`[!...]` negates) match characters inside one segment;
- the empty glob `""` matches the root module.

Every glob and regex is matched by RE2, in time linear in the pattern and the text, so no policy can make matching
backtrack (Python's `re` holds the GIL for minutes on a pattern such as `(\w+\.?)+!`). A regex is written in the part
of Python's syntax that RE2 reads the same way; what RE2 lacks (backreferences, lookarounds, atomic groups,
possessive repeats, ...) is refused when the policy is validated, as are patterns past the bounds below. As in RE2,
`\d`, `\w`, `\s` and `\b` are ASCII classes.
"""

from __future__ import annotations

import re
import warnings

import re2
from re2 import _re2  # the binding's compiled program: see `Pattern`

from ..errors import Error

#: Policy names, `extends` targets and rule ids: a file stem, never a path (`is_policy_name` also refuses `..`).
POLICY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_SEGMENT_CHAR_CLASS = re.compile(r"\[(!?)(\]?[^\]]*)\]")
#: The same two rules as JSON Schema patterns (ECMA regexes, for editors): a name without `..`, and a class entry
#: with its wildcards; `tests/policy/test_schema.py` draws documents and holds the schema to the validators.
POLICY_NAME_SCHEMA = r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]|\.[A-Za-z0-9_-])*\.?$"
CLASS_NAME_SCHEMA = r"^[A-Za-z_*?][A-Za-z0-9_*?]*(?:\.[A-Za-z_*?][A-Za-z0-9_*?]*)*$"

#: The most characters one glob or regex may have.
MAX_PATTERN_LENGTH = 1000
#: The most segments with a wildcard one glob may have, once each run of `**` counts as one.
MAX_GLOB_WILDCARDS = 32
#: The most RE2 instructions one pattern may compile to: with the text's length, the bound on a match's cost.
MAX_PROGRAM_SIZE = 10_000

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is a diagnostic, not a line on stderr
_OPTIONS.never_capture = True  # only whether a pattern matches counts: no submatches to track
_FULL = _re2.RE2.Anchor.ANCHOR_BOTH
_ANY_SEGMENTS = r"(?:\.[^.]+)*"  # `**`

# Python regex syntax that RE2 refuses or reads otherwise, found by `_unsupported` (the first match wins).
_GROUPS = (
    ("(?P=", "a backreference `(?P=name)`"),
    ("(?=", "a lookahead `(?=...)`"),
    ("(?!", "a negative lookahead `(?!...)`"),
    ("(?<=", "a lookbehind `(?<=...)`"),
    ("(?<!", "a negative lookbehind `(?<!...)`"),
    ("(?>", "an atomic group `(?>...)`"),
    ("(?(", "a conditional group `(?(group)yes|no)`"),
    ("(?#", "a comment `(?#...)`"),
)
_FLAGS = re.compile(r"\(\?([aiLmsux]*)(?:-([imsx]*))?[:)]")
_REPEAT = re.compile(r"\{([0-9]*)(?:(,)([0-9]*))?\}")
_OCTAL = re.compile(r"[0-7]{3}")
_ESCAPES = {
    "Z": "`\\Z` (write `$`: the regex is full-matched anyway)",
    "u": "a `\\u` escape (write the character itself)",
    "U": "a `\\U` escape (write the character itself)",
    "N": "a `\\N{...}` escape (write the character itself)",
}


class PatternError(Error, ValueError):
    """A selector entry that does not compile; `offset` is the index of the faulty character, if one is."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


class Pattern:
    """A glob or regex compiled by RE2, whose matching takes time linear in the text, whatever the pattern.

    `source` is the RE2 regex and `program_size` its instruction count. A call into RE2 costs a few times what
    Python's `re` takes on a module path, so `fullmatch` first tries the text's literal `prefix` and `suffix`, which
    every match has, and most paths fail there. It calls the binding's program directly: the `re2` module's own
    `fullmatch` builds a match object per call, five times the cost of the match.
    """

    __slots__ = ("source", "program_size", "_match", "_prefix", "_suffix")

    def __init__(self, source: str, program: _re2.RE2, prefix: str = "", suffix: str = "") -> None:
        self.source = source
        self.program_size = program.ProgramSize()
        self._match = program.Match
        self._prefix, self._suffix = prefix, suffix

    def fullmatch(self, text: str) -> bool:
        if not (text.startswith(self._prefix) and text.endswith(self._suffix)):
            return False
        data = text.encode(errors="surrogatepass")
        return self._match(_FULL, data, 0, len(data))[0][0] >= 0

    def __repr__(self) -> str:
        return f"Pattern({self.source!r})"


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


def compile_glob(glob: str) -> Pattern:
    """Translate a path or class glob into an RE2 regex over `"." + path` (the root is the empty path).

    A run of `**` segments means one `**` and compiles to one, so repeating it costs nothing.
    """
    _check_length("path glob", glob)
    parts: list[str] = []
    wildcards = 0
    offset = 0
    for segment in glob.split(".") if glob else ():
        if segment == "":
            raise PatternError(f"empty segment in path glob `{glob}` (stray `.`)", offset)
        if segment == "**":
            if parts[-1:] != [_ANY_SEGMENTS]:
                parts.append(_ANY_SEGMENTS)
                wildcards += 1
        elif "**" in segment:
            raise PatternError(
                f"`**` must be a whole segment in `{glob}` (write `a.**.b`, not `a**`)",
                offset + segment.index("**"),
            )
        else:
            parts.append(r"\." + _translate_segment(segment, offset))
            wildcards += not is_exact_path(segment)
        if wildcards > MAX_GLOB_WILDCARDS:
            raise PatternError(
                f"path glob `{glob}` has more than {MAX_GLOB_WILDCARDS} segments with a wildcard "
                "(a run of `**` counts once)", offset
            )
        offset += len(segment) + 1
    return _compile("".join(parts), glob, *_literal_ends(glob))


def _literal_ends(glob: str) -> tuple[str, str]:
    """The text before a glob's first wildcard and after its last, as every `"." + path` it matches has them.

    The `.` before a `**` belongs to the `**` (which may match no segment), the `.` after it to the next segment.
    """
    first = min((i for i in map(glob.find, "*?[") if i >= 0), default=len(glob))
    if first == len(glob):
        return "." + glob if glob else "", ""
    prefix = "." + glob[:first]
    last = max(glob.rfind("*"), glob.rfind("?"), glob.rfind("]"))
    return prefix[:-1] if glob.startswith("**", first) else prefix, glob[last + 1 :]


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
            try:  # Python reads this class as RE2 does; it names a reversed range such as `[z-a]`
                re.compile(char_class)
            except re.error as exc:
                raise PatternError(f"invalid `[...]` in path glob segment `{segment}`: {exc.msg}", offset + i) from None
            out.append(char_class)
            i = found.end()
            continue
        elif ch == "]":
            raise PatternError(f"unmatched `]` in path glob segment `{segment}`", offset + i)
        else:
            out.append(re2.escape(ch))
        i += 1
    return "".join(out)


def glob_matches(pattern: Pattern, path: str) -> bool:
    return pattern.fullmatch("." + path if path else "")


def glob_literal_segments(glob: str) -> int:
    """How many segments of a glob are plain text: the tie-breaker between two globs."""
    return sum(1 for s in glob.split(".") if s and not any(c in s for c in "*?["))


def is_exact_path(glob: str) -> bool:
    return not any(c in glob for c in "*?[")


def compile_regex(source: str) -> Pattern:
    """A regex written in Python's syntax, refused unless RE2 reads it the same way, full-matched by RE2."""
    _check_length("regex", source)
    try:
        with warnings.catch_warnings():  # "possible nested set": Python's future reading of `[[`, not RE2's
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(source)  # Python's syntax, with its located messages; Python never matches it
    except re.error as exc:
        raise PatternError(f"invalid regex `{source}`: {exc.msg}", exc.pos) from None
    except RecursionError:
        raise PatternError(f"regex `{source}` is nested too deeply") from None
    except OverflowError as exc:  # a repeat count beyond what `re` can hold
        raise PatternError(f"invalid regex `{source}`: {exc}") from None
    unsupported = _unsupported(source)
    if unsupported is not None:
        construct, offset = unsupported
        raise PatternError(f"regex `{source}`: RE2 (the linear-time matcher) does not support {construct}", offset)
    return _compile(source, source)


def _unsupported(source: str) -> tuple[str, int] | None:
    """The first construct of a valid Python regex that RE2 refuses or reads otherwise, and its offset."""
    i, in_class = 0, False
    while i < len(source):
        ch = source[i]
        if ch == "\\":
            escaped = source[i + 1]
            if escaped in _ESCAPES:
                return _ESCAPES[escaped], i
            if in_class and escaped == "b":
                return "`\\b` inside a class (write `\\x08` for a backspace)", i
            if not in_class and escaped in "123456789" and not _OCTAL.match(source, i + 1):
                return f"a backreference `\\{escaped}`", i
            i += 2
            continue
        if in_class:
            if ch == "]":
                in_class = False
            elif source.startswith("[:", i):
                return "`[:` inside a class (RE2 reads `[:name:]` as a POSIX class: write `\\[`)", i
        elif ch == "[":
            in_class = True
            i += 1 + source.startswith("^", i + 1)
            i += source.startswith("]", i)  # a `]` first in a class is a character
            continue
        elif ch == "(" and source.startswith("(?", i):
            construct = next((name for prefix, name in _GROUPS if source.startswith(prefix, i)), None)
            if construct is not None:
                return construct, i
            flags = _FLAGS.match(source, i)
            bad = flags and next((c for c in flags.group(0) if c in "aLux"), None)
            if bad:
                return f"the `{bad}` flag", i + flags.group(0).index(bad)
            i += 2
            continue
        elif ch == "{" and (repeat := _REPEAT.match(source, i)) and repeat.group(0) != "{}":
            if repeat.group(2) and not repeat.group(1):
                return f"`{repeat.group(0)}` (RE2 reads it as text: write `{{0{repeat.group(0)[1:]}`)", i
            i = repeat.end()
            if source.startswith("+", i):
                return "a possessive quantifier (`+` after a repeat)", i
            continue
        elif ch in "*+?" and source.startswith("+", i + 1):
            return "a possessive quantifier (`+` after a repeat)", i + 1
        i += 1
    return None


def _check_length(kind: str, pattern: str) -> None:
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternError(f"{kind} of {len(pattern)} characters: the limit is {MAX_PATTERN_LENGTH}",
                           MAX_PATTERN_LENGTH)


def _compile(source: str, pattern: str, prefix: str = "", suffix: str = "") -> Pattern:
    """RE2's program for `source`, the regex that `pattern` (a glob or a regex, as its messages quote) means."""
    program = _re2.RE2(source.encode(errors="surrogatepass"), _OPTIONS)
    if not program.ok():
        error = program.error().decode(errors="replace")
        fragment = error.partition(": ")[2]
        offset = pattern.find(fragment) if fragment else -1
        raise PatternError(f"RE2 does not support `{pattern}`: {error}", offset if offset >= 0 else None)
    compiled = Pattern(source, program, prefix, suffix)
    if compiled.program_size > MAX_PROGRAM_SIZE:
        raise PatternError(f"`{pattern}` compiles to {compiled.program_size} RE2 instructions: the limit is "
                           f"{MAX_PROGRAM_SIZE} (a large `{{n}}` repeats its pattern n times)")
    return compiled
