"""A command-line option holding JSON (`--model-config '{"num_hidden_layers": 2}'`), read within bounds.

`json.loads` recurses per nesting level and hands integers of any length to `int()` (a 4,400-digit number raises a
bare ValueError, a deeply nested one a RecursionError): either printed a traceback. Here the text is at most
`MAX_CHARS` characters, nests at most `MAX_DEPTH` levels (counted in one pass before parsing) and holds no number
over `MAX_NUMBER_CHARS` characters, and any problem is one `OptionError` naming the option, for a usage error.
"""

from __future__ import annotations

import json

from ...errors import Error

MAX_CHARS = 65_536
MAX_DEPTH = 32
MAX_NUMBER_CHARS = 64  # as in policies (`policy.limits`)


class OptionError(Error, ValueError):
    """A JSON option that cannot be read, with what is wrong in words."""


def json_option(option: str, text: str | None) -> object:
    """The value of `option` (None when it was not given)."""
    if text is None:
        return None
    if len(text) > MAX_CHARS:
        raise OptionError(f"{option}: {len(text)} characters of JSON; the limit is {MAX_CHARS}")
    if _depth(text) > MAX_DEPTH:
        raise OptionError(f"{option}: JSON nested more than {MAX_DEPTH} levels deep; the limit is {MAX_DEPTH}")
    try:
        return json.loads(text, parse_int=_number(int, option), parse_float=_number(float, option),
                          parse_constant=_constant(option))
    except OptionError:
        raise
    except ValueError as exc:
        raise OptionError(f"{option} is not JSON: {exc}") from None


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, outside its strings."""
    depth = deepest = 0
    in_string = escaped = False
    for character in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (character == "\\", character != '"')
        elif character == '"':
            in_string = True
        elif character in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif character in "]}":
            depth -= 1
    return deepest


def _number(kind, option: str):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise OptionError(f"{option}: a number of {len(text)} characters; the limit is {MAX_NUMBER_CHARS}")
        return kind(text)

    return parse


def _constant(option: str):
    def parse(name: str):
        raise OptionError(f"{option}: `{name}` is not JSON")

    return parse
