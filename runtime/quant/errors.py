"""The quant stage's one error, which its narrower ones refine."""

from __future__ import annotations

from ...errors import Error


class QuantError(Error, ValueError, TypeError):
    """Quantized weights that cannot be made, read or computed as asked: a group size the format does not take,
    storage of another size than its layout, a format that only comes from a file (a ValueError or TypeError, as
    these were before)."""
