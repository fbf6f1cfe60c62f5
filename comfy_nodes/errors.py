"""The nodes' error for an input they cannot take."""

from __future__ import annotations

from ..errors import Error


class NodeInputError(Error, ValueError):
    """An input a node cannot take (a model another loader loaded, an image or a recording of another shape, a choice
    the node does not have, a folder without a tokenizer): ComfyUI shows the message on the node."""
