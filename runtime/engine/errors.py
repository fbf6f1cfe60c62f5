"""The engine's error for a converted module that cannot compute as called."""

from __future__ import annotations

from ...errors import Error


class EngineError(Error, RuntimeError, TypeError, ValueError):
    """A converted module called in a way it cannot compute (no input, a padding mode it does not have), or whose
    weights changed past what was placed (a TypeError, ValueError or RuntimeError, as each was before)."""
