"""The compile stage's one error."""

from __future__ import annotations

from ...errors import Error


class CompileError(Error, ValueError, TypeError):
    """A compile request that cannot be met: an unknown setting, mode or backend, something that is no torch module
    nor a host's model, statistics of a model never armed (a ValueError or TypeError, as these were before)."""
