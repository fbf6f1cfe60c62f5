"""The one error every checkpoint problem is: unreadable, corrupt, changed since it was read, or not the model's."""

from __future__ import annotations

import re

from ...errors import Error

_SHOWN = 20  # lines of the message at most
_NAMED = 3  # tensors named in a line that stands for many
_TENSOR = re.compile(r"(?P<where>.*?)tensor `(?P<name>[^`]*)`: (?P<what>.*)", re.DOTALL)
_DETAIL = re.compile(r"`[^`]*`|\d+")  # what differs between two reports of one problem: names and numbers


class LoadOptionError(Error, ValueError):
    """A load asked with an option no load takes (an arithmetic there is not)."""


class CheckpointError(Error, ValueError):
    """A checkpoint cannot be read, or does not fit the model; `problems` lists every reason.

    The message summarizes: the problems that differ only in the tensor (and its sizes and offsets) are one line,
    the first in full and the others by name, then a count; never a line per tensor of a file.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = summarized(problems)
        shown = lines[:_SHOWN] + ([f"... and {len(lines) - _SHOWN} more problems"] if len(lines) > _SHOWN else [])
        super().__init__("\n".join(shown))


def summarized(problems: list[str]) -> list[str]:
    """One line per kind of problem, in the order each kind first appears."""
    groups: dict[tuple[str, str] | int, list[tuple[str, str]]] = {}
    for index, problem in enumerate(problems):
        found = _TENSOR.fullmatch(problem)
        key = (found["where"], _DETAIL.sub("#", found["what"])) if found else index
        groups.setdefault(key, []).append((problem, found["name"] if found else ""))
    lines = []
    for members in groups.values():
        first, _ = members[0]
        if len(members) == 1:
            lines.append(first)
            continue
        names = ", ".join(f"`{name}`" for _, name in members[1:_NAMED + 1])
        more = f" and {len(members) - 1 - _NAMED} more" if len(members) > _NAMED + 1 else ""
        alike = f"{len(members) - 1} more tensor{'s' if len(members) > 2 else ''} alike"
        lines.append(f"{first} ({alike}: {names}{more})")
    return lines
