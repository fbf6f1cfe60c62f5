"""Memory sizes as people write and read them: `"2GiB"`, `"1.5GB"`, `512 * 1024**2` in; `"1.5 GiB"` out.

Units follow accelerate's `max_memory` (and the SI/IEC standards): `KB`/`MB`/`GB`/`TB` are powers of 1000,
`KiB`/`MiB`/`GiB`/`TiB` powers of 1024, case-insensitive, with an optional space and `B` alone for bytes.
"""

from __future__ import annotations

import math
import numbers
import re

from ..errors import Error

UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_BY_NAME = {name.lower(): factor for name, factor in UNITS.items()}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_SHOWN = ("B", "KiB", "MiB", "GiB", "TiB")


class SizeError(Error, ValueError):
    """A size that is no number of bytes: says what was given and what is expected."""


def parse_size(value: object, what: str = "size") -> int:
    """`value` in bytes: a whole, finite, non-negative number, or a string such as `"2GiB"` or `"1.5 GB"`."""
    given = value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value) if len(value) <= 64 else None
        unit = _BY_NAME.get(match.group(2).lower() or "b") if match else None
        if unit is None:
            raise SizeError(f"{what}={value!r}: write bytes with a unit, such as '2GiB' (2**30 bytes each) or "
                            f"'1.5GB' (10**9 bytes each); units: {', '.join(UNITS)}")
        value, whole = float(match.group(1)) * unit, unit > 1  # a fraction of a kilobyte is whole bytes
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SizeError(f"{what}={value!r}: a number of bytes or a string such as '2GiB' is expected")
    elif not math.isfinite(value) or value < 0:
        raise SizeError(f"{what}={value!r}: bytes are finite and not negative")
    else:
        whole = False
    if not whole and value != int(value):
        raise SizeError(f"{what}={given!r}: a number of bytes is whole (a share of a device is written '50%')")
    return int(value)


def human(size: int) -> str:
    """`size` bytes for people, in powers of 1024: `512 B`, `1.5 GiB`."""
    if abs(size) < 1024:
        return f"{size} B"
    power = min(int(math.log(abs(size), 1024)), len(_SHOWN) - 1)
    return f"{size / 1024**power:.1f} {_SHOWN[power]}"
