"""Reading a `.gguf` file into a `Checkpoint`: its header checked in full (`gguf_header`), its tensors read on demand.

Quantized tensors keep their raw GGML blocks and quant type; a tensor stored in another shape than its own
(ComfyUI-GGUF's `ORIGINAL_SHAPE`) is expanded to float32 at the read. Its own module, apart from the other readers,
so that the gguf package is imported only when a GGUF file is read.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import gguf
import torch
from torch import Tensor

from ..quant.gguf_dequant import STORED_FLOATS, dequantize
from . import limits
from .checked_file import CheckedFile, check_regular
from .errors import CheckpointError
from .gguf_header import Value, read_header
from .stored import Checkpoint, FileRange, StoredTensor

ORIGINAL_SHAPE = "comfy.gguf.orig_shape.{name}"
"""ComfyUI-GGUF's key for a tensor stored in another shape than its own (a 5-D Conv3d weight, which no GGUF holds,
or rows regrouped by 256): an array of the tensor's dimensions. Streamwise reads it and writes it alike."""


def _original_shape(path: Path, metadata: dict[str, Value], name: str, stored: tuple[int, ...]):
    """The shape `ORIGINAL_SHAPE` gives tensor `name`, checked against the elements it has; None without one."""
    key = ORIGINAL_SHAPE.format(name=name)
    found = metadata.get(key)
    if found is None:
        return None
    dims = found.integers
    if not found.array or not dims or any(d <= 0 for d in dims) or len(dims) > limits.MAX_ORIGINAL_DIMS \
            or math.prod(dims) != math.prod(stored):
        raise CheckpointError([f"{path}: metadata `{key}`: {found.value!r} is no shape of the {math.prod(stored)} "
                               f"elements tensor `{name}` holds (stored as {list(stored)})"])
    return tuple(dims)


def _expanded(blocks: FileRange, qtype, stored: tuple[int, ...], original: tuple[int, ...]) -> Tensor:
    """Quantized blocks laid out as `stored`, as float32 values of the tensor's own shape."""
    return dequantize(blocks(), qtype, stored).reshape(original)


def read_gguf(path: Path) -> Checkpoint:
    """A GGUF file, its header checked in full (`gguf_header`), its tensors read on demand."""
    plain = {  # stored as they compute: never residents, read as tensors of their dtype
        **STORED_FLOATS,
        gguf.GGMLQuantizationType.F64: torch.float64, gguf.GGMLQuantizationType.I8: torch.int8,
        gguf.GGMLQuantizationType.I16: torch.int16, gguf.GGMLQuantizationType.I32: torch.int32,
        gguf.GGMLQuantizationType.I64: torch.int64,
    }
    check_regular(path)
    try:
        with open(path, "rb") as handle:
            checked = CheckedFile(path, handle)
            header = read_header(path, handle, checked.size)
    except OSError as exc:
        raise CheckpointError([f"{path}: not a readable GGUF file ({exc})"]) from None
    checked.name_tensors({info.name: (header.data_start + info.offset, info.nbytes) for info in header.tensors})
    tensors = {}
    for info in header.tensors:
        shape = tuple(reversed(info.dims))
        offset = header.data_start + info.offset
        original = _original_shape(path, header.metadata, info.name, shape)
        if info.qtype in plain:
            read = FileRange(checked, offset, plain[info.qtype], original or shape)
            tensors[info.name] = StoredTensor(info.name, str(path), original or shape, plain[info.qtype], read)
        elif original is not None:  # blocks laid out in another shape than the model's: expanded, then reshaped
            blocks = FileRange(checked, offset, torch.uint8, (info.nbytes,))
            tensors[info.name] = StoredTensor(
                info.name, str(path), original, torch.float32, partial(_expanded, blocks, info.qtype, shape, original),
                note=f"dequantized from {info.qtype.name}: stored as {list(shape)}, its shape is {list(original)} "
                     f"(`{ORIGINAL_SHAPE}`)")
        else:
            read = FileRange(checked, offset, torch.uint8, (info.nbytes,))
            tensors[info.name] = StoredTensor(info.name, str(path), shape, torch.uint8, read, info.qtype)
    found = header.metadata.get(gguf.Keys.General.ARCHITECTURE)
    architecture = found.value if found is not None and isinstance(found.value, str) else None
    return Checkpoint(str(path), tensors, "gguf", architecture, header.metadata, checked, header.data_start)
