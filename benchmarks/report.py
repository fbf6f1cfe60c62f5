"""How the GPU benchmarks hand over their figures: printed as JSON, and written to `--out` where given (the device
tool brings that file back)."""

from __future__ import annotations

import json


def emit(results: dict, out: str | None) -> None:
    """Print `results` as indented JSON; write the same text to `out` where given."""
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
