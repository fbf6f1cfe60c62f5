"""The one error every checkpoint problem is: unreadable, corrupt, changed since it was read, or not the model's."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not fit the model; `problems` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__("\n".join(shown))
