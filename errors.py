"""`streamwise.Error`: the base of every error Streamwise raises on purpose, so that a caller can catch them all.

Each stage's error derives from it and keeps the builtin it has always been (`CheckpointError` is a `ValueError`,
`ConversionError` a `RuntimeError`), so existing `except` clauses keep working. Imports nothing: every stage, the
schemas included, can derive from it.
"""


class Error(Exception):
    """Something Streamwise refuses or cannot do, said with where and what."""
