"""The size limits of a policy document, checked by one linear pre-scan of the raw text before `tomllib` runs.

`tomllib` is quadratic in the segments of a dotted key (a 50,000-segment key ran 30 s at 3 GB), raises a bare
`ValueError` for a decimal integer over 4,300 digits, and everything after it (spans, validation, rendering)
costs per key and value. So the text is refused, with a located diagnostic naming the limit, when it has:
- a line longer than `MAX_LINE_CHARS` characters;
- a dotted key (table headers included) of more than `MAX_KEY_SEGMENTS` segments;
- a key segment longer than `MAX_KEY_CHARS` characters;
- a number longer than `MAX_NUMBER_CHARS` characters (any integer of that size already reads like a mistake);
- more than `MAX_TOKENS` keys, values and dots in all.
The file size (`source.MAX_POLICY_BYTES`), nesting (`source.MAX_NESTING`), rules per section
(`MAX_RULES_PER_SECTION`, counted on the parsed document by `validate`) and files per `extends` chain
(`MAX_EXTENDS_CHAIN`, counted by `load` as it follows the chain) are the other limits. Every limit is
about 100 times what the largest shipped policy needs.
"""

from __future__ import annotations

import re

MAX_LINE_CHARS = 10_000
MAX_KEY_SEGMENTS = 16
MAX_KEY_CHARS = 256
MAX_NUMBER_CHARS = 64
MAX_TOKENS = 10_000
MAX_RULES_PER_SECTION = 500
MAX_EXTENDS_CHAIN = 32  # policies in one `extends` chain, the policy itself included

#: TOML's four strings, matched whole by runs of plain characters. Each always matches (an unterminated one runs
#: to the end of its line or of the text), so nothing backtracks or is tried again from a later position.
STRING = (
    r'"""(?:[^"\\]+|\\[\s\S]?|"{1,2}(?!"))*(?:"{3,5}|\Z)'
    r"|'''[\s\S]*?(?:'{3,5}|\Z)"
    r'|"(?:[^"\\\n]+|\\.?)*(?:"|$)'
    r"|'[^'\n]*(?:'|$)"
)
_TOKEN = re.compile(
    rf"(?P<string>{STRING})|(?P<comment>#[^\n]*)|(?P<bare>[A-Za-z0-9_+:-]+)|(?P<dot>\.)|(?P<end>=|\])"
    r"|(?P<header>^[ \t]*\[)",
    re.MULTILINE,
)


def first_excess(text: str, lines: list[str]) -> tuple[int, int, str] | None:
    """The first place `text` exceeds a limit, as (line, column, message), or None when it is within all of them."""
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_LINE_CHARS:
            return number, MAX_LINE_CHARS + 1, f"line is {len(line)} characters long; the limit is {MAX_LINE_CHARS}"
    found = _scan(text)
    if found is None:
        return None
    offset, message = found
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - line_start + 1, message


def _scan(text: str) -> tuple[int, str] | None:
    """Walk the keys, values and dots once; the offset and message of the first one over a limit."""
    segments, dotted, in_header = 0, False, False
    for tokens, match in enumerate(_TOKEN.finditer(text)):
        kind, start = match.lastgroup, match.start()
        if tokens >= MAX_TOKENS:
            return start, f"more than {MAX_TOKENS} keys, values and dots; the limit is {MAX_TOKENS}"
        if kind in ("string", "bare"):
            segments = segments + 1 if dotted else 1
            dotted = False
            if segments > MAX_KEY_SEGMENTS:
                return start, f"a dotted key of more than {MAX_KEY_SEGMENTS} segments; the limit is {MAX_KEY_SEGMENTS}"
            size = match.end() - start - (2 if kind == "string" else 0)  # a key's quotes are not part of it
            if kind == "bare" and size > MAX_NUMBER_CHARS and match.group()[0] in "0123456789+-":
                return start, f"a number of {size} characters; the limit is {MAX_NUMBER_CHARS}"
            if size > MAX_KEY_CHARS and _is_key(text, match.end(), in_header):
                return start, f"a key of {size} characters; the limit is {MAX_KEY_CHARS}"
        elif kind == "dot":
            dotted = segments > 0
        elif kind == "header":
            in_header = True
        elif kind == "end":  # `=` ends a key, `]` a header (a header holds no `=`)
            segments, dotted, in_header = 0, False, False
    return None


_KEY_END = re.compile(r"[ \t]*(?:\.|=|\])")


def _is_key(text: str, end: int, in_header: bool) -> bool:
    """Whether the token ending at `end` is a key segment: a dot, `=` or (in a header) `]` follows it."""
    follows = _KEY_END.match(text, end)
    return follows is not None and (follows.group().strip() != "]" or in_header)
