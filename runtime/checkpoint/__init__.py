"""Files <-> trees: reading `.safetensors`/`.gguf`, filling a skeleton, builders, and writing GGUF."""

from .fill import LoadReport, load
from .pretrained import load_pretrained, load_tokenizer
from .readers import CheckpointError, open_checkpoint
from .skeleton import build_skeleton, register_builder, skeleton

__all__ = ["CheckpointError", "LoadReport", "build_skeleton", "load", "load_pretrained", "load_tokenizer",
           "open_checkpoint", "register_builder", "skeleton"]
