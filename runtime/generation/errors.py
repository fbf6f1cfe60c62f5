"""The generation stage's one error."""

from __future__ import annotations

from ...errors import Error


class GenerationError(Error, ValueError):
    """Generation that cannot start or finish: no processor for the model, a model of another kind, a script with
    nothing to speak, a sampling mode there is not: what is wrong and what to do."""
