"""Located, coded problem reports and their two renderings (compiler-style text, JSON).

Every problem Streamwise finds in a policy becomes a `Diagnostic`:
- with a stable kebab-case code from `CODES`, so tools can match on it;
- with a message saying what was found and what is allowed, and a did-you-mean suggestion where one is close;
- located at the `file:line:col` of the offending key or value, so an editor can jump there.

The CLI, `PolicyError` and the ComfyUI nodes render the same records, and all ask `errors_in` whether there are
errors: warnings alone never make a policy unusable.

Rendering is bounded whatever the policy holds, and says what it leaves out: a source line shows a window of
`MAX_SNIPPET_CHARS` around the column, a message, help or note at most `MAX_TEXT_CHARS`, and a report at most
`MAX_RENDERED` diagnostics and about `MAX_RENDERED_CHARS` characters, then `... N more diagnostics not shown`.
A stage keeps at most `MAX_DIAGNOSTICS` diagnostics (`capped`), so one construct cannot produce thousands.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ...errors import Error

Severity = Literal["error", "warning"]
MAX_DIAGNOSTICS = 100
MAX_SNIPPET_CHARS = 120
MAX_TEXT_CHARS = 500
MAX_RENDERED = 50
MAX_RENDERED_CHARS = 20_000
_MAX_NOTES_SHOWN = 8

#: Every code a diagnostic can carry. Codes are stable: tools may match on them.
CODES: dict[str, str] = {
    "unreadable-file": "the policy file cannot be read",
    "file-too-large": "the policy file is larger than a policy can reasonably be (1 MiB)",
    "invalid-encoding": "the file is not UTF-8",
    "invalid-toml": "TOML syntax error, or text over a reader limit (line length, key depth or length, number size)",
    "missing-key": "a required key or table is absent",
    "unknown-key": "a key the format does not have (often a typo: see the suggestion)",
    "invalid-type": "a value of the wrong TOML type",
    "invalid-value": "a value outside what the key allows",
    "bad-glob": "a path glob that does not compile",
    "bad-regex": "a regex that does not compile",
    "empty-selector": "a selector without any `class`, `path` or `regex` entry",
    "duplicate-id": "two rules of one section share an id",
    "rule-conflict": "two equally specific rules select the same modules but disagree",
    "name-mismatch": "`[policy] name` differs from the file name",
    "unsupported-version": "a `schema_version` this runtime cannot read",
    "deprecated-key": "a key of an older format version that was migrated (warning)",
    "unknown-policy": "no policy of that name in the policy folders (or a name no file can have)",
    "unreadable-policy": "`auto` cannot choose while a policy file in the folders cannot be read",
    "unknown-extends": "`extends` names a policy that does not exist",
    "invalid-extends": "`extends` names a policy that has errors",
    "extends-cycle": "policies extend each other in a cycle",
    "unknown-backend": "a compile backend torch does not ship (warning)",
    "unmatched-rule": "a rule that is not `optional` matches no module of the model",
    "stream-container": "a stream rule selects a module whose children hold parameters",
    "stranded-tensors": "parameters or buffers that no rule handles (warning)",
    "invalid-group-size": "a ConvRot group size that does not divide a selected layer's in_features",
    "quant-unsupported": "an INT8/INT4 quant rule selects a layer that is not a Linear",
}


@dataclass(frozen=True)
class Location:
    file: str
    line: int
    col: int
    end_col: int
    source_line: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Note:
    """A second place that explains the first (the other rule of a conflict, a link of a cycle)."""

    message: str
    location: Location | None = None


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    location: Location | None = None
    severity: Severity = "error"
    key_path: str | None = None
    suggestion: str | None = None
    allowed: tuple[str, ...] = ()
    help: str | None = None
    notes: tuple[Note, ...] = ()

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def to_dict(self) -> dict:
        def place(location: Location | None) -> dict:
            if location is None:
                return {"file": None, "line": None, "col": None, "end_col": None}
            return {"file": location.file, "line": location.line, "col": location.col, "end_col": location.end_col}

        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            **place(self.location),
            "key_path": self.key_path,
            "suggestion": self.suggestion,
            "allowed": list(self.allowed),
            "help": self.help,
            "notes": [{"message": n.message, **place(n.location)} for n in self.notes],
        }


def errors_in(diagnostics: Iterable[Diagnostic]) -> bool:
    """Whether any of `diagnostics` is an error (warnings alone leave a policy usable)."""
    return any(d.is_error for d in diagnostics)


class PolicyError(Error):
    """A policy could not be loaded; `diagnostics` holds every located problem found."""

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics = tuple(diagnostics)
        super().__init__(render_text(self.diagnostics))


def capped(diagnostics: Sequence[Diagnostic], found: int | None = None) -> list[Diagnostic]:
    """At most `MAX_DIAGNOSTICS` of `diagnostics`; the last one kept says how many of the `found` were dropped."""
    found = len(diagnostics) if found is None else found
    if found <= MAX_DIAGNOSTICS:
        return list(diagnostics)
    kept = list(diagnostics[:MAX_DIAGNOSTICS])
    dropped = Note(f"{found - MAX_DIAGNOSTICS} more problems were found and not reported; fix these first")
    kept[-1] = dataclasses.replace(kept[-1], notes=(*kept[-1].notes, dropped))
    return kept


def clip(text: str, limit: int | None = None) -> str:
    """`text`, or its start and how much was left out when it is longer than `limit` (`MAX_TEXT_CHARS`)."""
    limit = MAX_TEXT_CHARS if limit is None else limit
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def did_you_mean(word: object, options: Iterable[str]) -> str | None:
    """The closest option to a misspelled word, if one is close enough to be a likely intent."""
    if not isinstance(word, str):
        return None
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=0.7)
    return matches[0] if matches else None


def format_key_path(path: Sequence[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# text -----------------------------------------------------------------------------------------
_MAX_ALLOWED_SHOWN = 16
#: Control characters a policy may smuggle into a message (NUL, terminal escapes), written as escapes instead.
_ESCAPED = {code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F) if code != 0x0A}


def render_text(diagnostics: Iterable[Diagnostic]) -> str:
    """The diagnostics compiler-style, within `MAX_RENDERED` of them and about `MAX_RENDERED_CHARS` characters."""
    diagnostics = list(diagnostics)
    shown, size = [], 0
    for d in diagnostics[:MAX_RENDERED]:
        text = _render_one(d)
        if shown and size + len(text) > MAX_RENDERED_CHARS:
            break
        shown.append(text)
        size += len(text) + 2
    left = len(diagnostics) - len(shown)
    if left:
        shown.append(f"... {left} more diagnostic{'' if left == 1 else 's'} not shown")
    return "\n\n".join(shown).translate(_ESCAPED)


def _render_one(d: Diagnostic) -> str:
    notes = d.notes[:_MAX_NOTES_SHOWN]
    places = [d.location, *(n.location for n in notes)]
    width = max((len(str(p.line)) for p in places if p is not None), default=1)
    pad = " " * width
    lines = [f"{d.severity}[{d.code}]: {clip(d.message)}"]
    label = f"did you mean `{clip(d.suggestion, 80)}`?" if d.suggestion else ""
    if d.location is not None:
        lines += [f"{pad}--> {d.location}", *_snippet(d.location, "^", label, width)]
    elif label:
        lines.append(f"{pad} = {label}")
    for note in notes:
        if note.location is None:
            lines.append(f"{pad} = note: {clip(note.message)}")
        else:
            lines += [f"{pad}::: {note.location}", *_snippet(note.location, "-", clip(note.message), width)]
    if len(d.notes) > len(notes):
        lines.append(f"{pad} = note: and {len(d.notes) - len(notes)} more notes not shown")
    if d.allowed:
        shown = ", ".join(d.allowed[:_MAX_ALLOWED_SHOWN])
        more = len(d.allowed) - _MAX_ALLOWED_SHOWN
        lines.append(clip(f"{pad} = allowed: {shown}" + (f", and {more} more" if more > 0 else "")))
    if d.help:
        lines.append(f"{pad} = help: {clip(d.help)}")
    return "\n".join(lines)


def _snippet(location: Location, mark: str, label: str, width: int) -> list[str]:
    pad = " " * width
    if not location.source_line:
        return []
    source, col, end_col = _window(location.source_line, location.col, location.end_col)
    underline = " " * (col - 1) + mark * max(end_col - col, 1)
    return [
        f"{pad} |",
        f"{location.line:>{width}} | {source.replace(chr(9), ' ')}".rstrip(),
        f"{pad} | {underline}" + (f" {label}" if label else ""),
    ]


def _window(line: str, col: int, end_col: int) -> tuple[str, int, int]:
    """At most `MAX_SNIPPET_CHARS` of `line` around `col` (`...` marks a cut), and the columns within it."""
    if len(line) <= MAX_SNIPPET_CHARS:
        return line, col, end_col
    start = max(0, min(col - 1 - MAX_SNIPPET_CHARS // 3, len(line) - MAX_SNIPPET_CHARS))
    end = start + MAX_SNIPPET_CHARS
    head, tail = ("..." if start else ""), ("..." if end < len(line) else "")
    shift = len(head) - start
    return head + line[start:end] + tail, col + shift, min(end_col, end + 1) + shift


# json -----------------------------------------------------------------------------------------
def render_json(reports: dict[str, Sequence[Diagnostic]]) -> str:
    """Diagnostics grouped by file, with a summary, for editors and CI annotations."""
    return json.dumps(json_report(reports), indent=2)


def json_report(reports: dict[str, Sequence[Diagnostic]]) -> dict:
    """`render_json`'s document, for callers that add to it."""
    files = [
        {
            "file": file,
            "valid": not errors_in(diagnostics),
            "diagnostics": [d.to_dict() for d in diagnostics],
        }
        for file, diagnostics in reports.items()
    ]
    every = [d for diagnostics in reports.values() for d in diagnostics]
    summary = {
        "files": len(files),
        "errors": sum(d.is_error for d in every),
        "warnings": sum(not d.is_error for d in every),
    }
    return {"files": files, "summary": summary}
