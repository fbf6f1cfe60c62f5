"""Where each key and value of a TOML document sits, so diagnostics can point at them.

Neither `tomllib` nor pydantic keep source positions, so this scanner walks the text of a document that already
parsed and records, for every key path (`("stream", "rule", 0, "kind")`), the span of the key and of its value:
- array items get index paths, inline tables nested paths, and `[[array.of.tables]]` headers count their repeats;
- it runs only on text `tomllib` accepted, so it need not report syntax errors;
- best effort by design: whatever it cannot place makes a diagnostic fall back to the nearest recorded parent,
  never an exception.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from .limits import STRING

KeyPath = tuple  # of str (keys) and int (array indices)

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SCALAR = re.compile(r"[^,\]}#\n]*")  # numbers, booleans, dates (which may contain a space)
_STRING = re.compile(STRING, re.MULTILINE)
_BLANKS = re.compile(r"[ \t]*")
_BLANKS_AND_COMMENTS = re.compile(r"(?:[ \t\r\n]+|#[^\n]*)*")
_MAX_DEPTH = 64


@dataclass(frozen=True)
class Span:
    """1-based line and column of a stretch of source on one line; `end_col` is exclusive."""

    line: int
    col: int
    end_col: int


@dataclass(frozen=True)
class Located:
    key: Span
    value: Span | None = None


class _TooDeep(Exception):
    pass


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.line_starts = [0] + [m.end() for m in re.finditer(r"\n", text)]
        self.spans: dict[KeyPath, Located] = {}
        self.array_counts: dict[KeyPath, int] = {}

    # positions -------------------------------------------------------------------------------
    def span(self, start: int, end: int) -> Span:
        line = bisect.bisect_right(self.line_starts, start) - 1
        line_start = self.line_starts[line]
        line_end = self.line_starts[line + 1] - 1 if line + 1 < len(self.line_starts) else len(self.text)
        end = max(min(end, line_end), start + 1)
        return Span(line + 1, start - line_start + 1, end - line_start + 1)

    def record(self, path: KeyPath, key: Span, value: Span | None = None, *, overwrite: bool = True) -> None:
        if overwrite or path not in self.spans:
            self.spans[path] = Located(key, value)

    # lexing ----------------------------------------------------------------------------------
    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def skip_blanks(self) -> None:
        self.pos = _BLANKS.match(self.text, self.pos).end()

    def skip_blanks_and_newlines(self) -> None:
        self.pos = _BLANKS_AND_COMMENTS.match(self.text, self.pos).end()

    def skip_line(self) -> None:
        end = self.text.find("\n", self.pos)
        self.pos = len(self.text) if end == -1 else end + 1

    def key(self) -> list[tuple[str, int, int]]:
        """A dotted key: each part with its start and end offsets."""
        parts = []
        while True:
            self.skip_blanks()
            start = self.pos
            ch = self.peek()
            if ch in "\"'":
                value = self.string()
                name = value
            else:
                match = _BARE_KEY.match(self.text, self.pos)
                if not match:
                    raise ValueError("no key")
                self.pos = match.end()
                name = match.group()
            parts.append((name, start, self.pos))
            self.skip_blanks()
            if self.peek() != ".":
                return parts
            self.pos += 1

    def string(self) -> str:
        """Consume a string of any TOML flavour; return its content (escapes decoded loosely)."""
        match = _STRING.match(self.text, self.pos)
        self.pos = match.end()
        quotes = 3 if match.group().startswith(('"""', "'''")) else 1
        content = self.text[match.start() + quotes : self.pos - quotes]
        if match.group()[0] == '"' and quotes == 1 and "\\" in content:
            try:
                content = content.encode("latin-1", "backslashreplace").decode("unicode_escape")
            except UnicodeDecodeError:
                pass
        return content

    def value(self, path: KeyPath, depth: int) -> tuple[int, int]:
        if depth > _MAX_DEPTH:
            raise _TooDeep
        start = self.pos
        ch = self.peek()
        if ch in "\"'":
            self.string()
        elif ch == "[":
            self.pos += 1
            index = 0
            while True:
                self.skip_blanks_and_newlines()
                if self.peek() == "]":
                    self.pos += 1
                    break
                item = self.span(*self.value(path + (index,), depth + 1))
                self.record(path + (index,), item, item)
                index += 1
                self.skip_blanks_and_newlines()
                if self.peek() == ",":
                    self.pos += 1
        elif ch == "{":
            self.pos += 1
            while True:
                self.skip_blanks_and_newlines()
                if self.peek() == "}":
                    self.pos += 1
                    break
                self.key_value(path, depth + 1)
                self.skip_blanks_and_newlines()
                if self.peek() == ",":
                    self.pos += 1
        else:
            match = _SCALAR.match(self.text, self.pos)
            self.pos = match.end()
            return start, start + len(match.group().rstrip())
        return start, self.pos

    def key_value(self, table: KeyPath, depth: int) -> None:
        parts = self.key()
        path = table
        for name, start, end in parts[:-1]:
            path = path + (name,)
            self.record(path, self.span(start, end), overwrite=False)
        name, start, end = parts[-1]
        path = path + (name,)
        self.skip_blanks()
        self.pos += 1  # "="
        self.skip_blanks()
        value = self.value(path, depth)
        self.record(path, self.span(start, end), self.span(*value))

    def header(self) -> KeyPath:
        is_array = self.text.startswith("[[", self.pos)
        self.pos += 2 if is_array else 1
        parts = self.key()
        path: KeyPath = ()
        for i, (name, start, end) in enumerate(parts):
            path = path + (name,)
            last = i == len(parts) - 1
            if last and is_array:
                index = self.array_counts.get(path, 0)
                self.array_counts[path] = index + 1
                self.record(path, self.span(start, end), overwrite=False)
                path = path + (index,)
                self.record(path, self.span(start, end))
            else:
                self.record(path, self.span(start, end), overwrite=False)
                if path in self.array_counts:  # a sub-table of the latest array element
                    path = path + (self.array_counts[path] - 1,)
        self.skip_line()
        return path

    def document(self) -> None:
        table: KeyPath = ()
        while True:
            self.skip_blanks_and_newlines()
            if self.pos >= len(self.text):
                return
            if self.peek() == "[":
                table = self.header()
            else:
                self.key_value(table, 0)
                self.skip_blanks()
                if self.peek() == "#":
                    self.skip_line()


def record_spans(text: str) -> dict[KeyPath, Located]:
    """Map every key path of a parsed TOML document to its key and value spans."""
    scanner = _Scanner(text)
    try:
        scanner.document()
    except (_TooDeep, ValueError, IndexError, RecursionError):
        pass  # keep what was placed; callers fall back to parents
    return scanner.spans


def find(spans: dict[KeyPath, Located], path: KeyPath) -> tuple[KeyPath, Located] | None:
    """The deepest recorded prefix of `path`, with its spans."""
    for length in range(len(path), 0, -1):
        located = spans.get(tuple(path[:length]))
        if located is not None:
            return tuple(path[:length]), located
    return None
