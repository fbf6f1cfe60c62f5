"""Files <-> tensors: reading `.safetensors`/`.gguf` (checked, bounded), filling a built skeleton, writing GGUF."""

from .fill import LoadReport, load
from .pretrained import load_pretrained, load_tokenizer
from .readers import CheckpointError, open_checkpoint

__all__ = ["CheckpointError", "LoadReport", "build_skeleton", "load", "load_pretrained", "load_tokenizer",
           "open_checkpoint"]
