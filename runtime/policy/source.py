"""Reading a policy file: bytes to a TOML document that knows where its keys are.

Everything that can go wrong before validation becomes a located diagnostic here, never an exception:
- a path no file can have (too long, or holding a NUL: `folders.path_problem`), refused before any filesystem call;
- a missing or unreadable file, or one that is no regular file (a pipe or a device is never opened: it may never end);
- a file over `MAX_POLICY_BYTES` (read with that bound, so a huge file is never read whole);
- bytes that are not UTF-8 (located at the first bad byte);
- text over a size limit of `limits` (lines, keys, numbers, tokens), found by a linear pre-scan before `tomllib`;
- TOML syntax errors (and an integer `tomllib` cannot convert, should one pass the pre-scan);
- nesting deeper than `MAX_NESTING` (measured without recursion, before validation recurses over the document).
"""

from __future__ import annotations

import functools
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from .diagnostics import Diagnostic, Location
from .folders import SHIPPED_POLICY_DIR, path_problem
from .limits import first_excess
from .spans import KeyPath, Located, find, record_spans

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

MAX_POLICY_BYTES = 1 << 20
MAX_NESTING = 32  # a policy needs about 5 levels; deeper documents are refused before any recursion
_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_TOML_AT_END = re.compile(r"\s*\(at end of document\)\s*$")


@dataclass(frozen=True)
class PolicySource:
    """A parsed policy document with the spans of its keys."""

    file: str
    text: str
    document: dict
    spans: dict[KeyPath, Located]

    @functools.cached_property
    def lines(self) -> list[str]:
        """The text's lines, split once: a file with many problems locates each of them."""
        return self.text.split("\n")

    def locate(self, key_path: KeyPath, *, value: bool = False) -> Location:
        """Where `key_path` (or its deepest recorded parent) is; the value's span when asked."""
        found = find(self.spans, key_path)
        if found is None:
            return self.location(1, 1, 1)
        path, located = found
        span = located.value if (value and path == tuple(key_path) and located.value) else located.key
        return self.location(span.line, span.col, span.end_col)

    def location(self, line: int, col: int, end_col: int | None = None) -> Location:
        lines = self.lines
        source_line = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
        end_col = end_col if end_col is not None else col + 1
        return Location(self.file, line, col, end_col, source_line)


def read_source(path: Path, display: str) -> tuple[PolicySource | None, list[Diagnostic]]:
    """Read and parse one policy file; on failure return the located problem instead."""
    refused = path_problem(os.fspath(path))
    if refused is not None:
        return None, [_problem("unreadable-file", f"cannot read policy file: {refused}", display)]
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a device or a pipe: no size to trust, maybe no end
            return None, [_problem("unreadable-file", "cannot read policy file: not a regular file", display)]
        with open(path, "rb") as handle:
            data = handle.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        return None, [_problem("unreadable-file", f"cannot read policy file: {exc.strerror or exc}", display)]
    if len(data) > MAX_POLICY_BYTES:
        size = path.stat().st_size
        message = f"policy file is {size} bytes; the limit is {MAX_POLICY_BYTES}"
        return None, [_problem("file-too-large", message, display)]
    return parse_source(data, display)


def parse_source(data: bytes, display: str) -> tuple[PolicySource | None, list[Diagnostic]]:
    bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    data = data[bom:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        col = len(data[line_start : exc.start].decode("utf-8", "replace")) + 1
        source = PolicySource(display, data.decode("utf-8", "replace"), {}, {})
        return None, [
            Diagnostic(
                "invalid-encoding",
                f"policy files must be UTF-8; byte 0x{data[exc.start]:02x} at offset {bom + exc.start} is not",
                source.location(line, col),
            )
        ]
    source = PolicySource(display, text, {}, {})
    excess = first_excess(text, source.lines)
    if excess is not None:
        line, col, message = excess
        return None, [Diagnostic("invalid-toml", message, source.location(line, col))]
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return None, [_syntax_error(source, exc)]
    except RecursionError:
        return None, [Diagnostic("invalid-toml", "invalid TOML: nesting is too deep", source.location(1, 1))]
    except ValueError:  # an integer over Python's conversion limit: the pre-scan refuses any it sees
        return None, [Diagnostic("invalid-toml", "invalid TOML: a number is too large", source.location(1, 1))]
    if _nesting(document) > MAX_NESTING:
        return None, [Diagnostic(
            "invalid-toml", f"tables and arrays are nested more than {MAX_NESTING} levels deep", source.location(1, 1)
        )]
    return PolicySource(display, text, document, record_spans(text)), []


def _nesting(document: dict) -> int:
    """How deeply tables and arrays nest, measured without recursion."""
    deepest, stack = 0, [(document, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            break
        children = node.values() if isinstance(node, dict) else node
        stack += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
    return deepest


def _syntax_error(source: PolicySource, exc: Exception) -> Diagnostic:
    message = str(getattr(exc, "msg", None) or exc)
    line, col = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    position = _TOML_POSITION.search(message)
    if position:
        line, col = int(position.group(1)), int(position.group(2))
    elif _TOML_AT_END.search(message) or line is None:
        lines = source.lines
        line, col = len(lines), len(lines[-1]) + 1
    message = _TOML_AT_END.sub("", _TOML_POSITION.sub("", message))
    message = message[:1].lower() + message[1:]
    return Diagnostic("invalid-toml", f"invalid TOML: {message}", source.location(line, col))


def display_path(path: Path) -> str:
    """A path as the user would write it: relative to the working folder when inside it, and
    `streamwise/policies/...` for a shipped policy seen from elsewhere."""
    absolute = Path(os.path.abspath(path))  # not resolved: a symlink is shown by the name it was given
    for base, prefix in ((Path(os.path.abspath(Path.cwd())), ""), (SHIPPED_POLICY_DIR.parent, "streamwise/")):
        if absolute.is_relative_to(base):
            return prefix + absolute.relative_to(base).as_posix()
    return str(path)


def _problem(code: str, message: str, display: str) -> Diagnostic:
    return Diagnostic(code, message, Location(display, 1, 1, 1))
