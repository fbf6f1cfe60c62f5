"""What a checkpoint reader gives: the checkpoint, its tensors and where their bytes lie. The readers of each format
(`readers` for safetensors, `gguf_reader`) share these, and nothing else of each other."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .checked_file import CheckedFile

if TYPE_CHECKING:  # the gguf package is imported only where a GGUF file is read
    from .gguf_header import Value


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint: its logical shape, storage dtype, GGUF quant type if any."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], Tensor] = field(repr=False, compare=False)
    qtype: object = None  # the gguf.GGMLQuantizationType of a quantized GGUF tensor
    note: str | None = None  # why the values are not the file's own (dequantized and transformed on the way)


@dataclass
class Checkpoint:
    path: str
    tensors: dict[str, StoredTensor]
    kind: str  # "safetensors" or "gguf"
    architecture: str | None = None  # a GGUF's `general.architecture` ("streamwise" for files Streamwise writes)
    metadata: dict[str, Value] = field(default_factory=dict, repr=False)  # a GGUF's, checked
    file: CheckedFile | None = field(default=None, repr=False, compare=False)  # a single file's reads
    header_bytes: int = 0  # where a GGUF's tensor data starts

    def header_copy(self):
        """A context giving a path to a private copy of this single file's header (`CheckedFile.private_copy`): what
        a reader that maps a path (transformers') is handed, so it sees what was checked and cannot crash."""
        return self.file.private_copy(self.header_bytes)


@dataclass(frozen=True)
class FileRange:
    """A tensor's bytes at `offset` in a checked file: called, they are read into memory of their own
    (`checked_file`); as a `StoredTensor.read` that nothing transformed, it is also where the file tier reads them
    back from (`engine.file_tier.FileSource`)."""

    file: CheckedFile
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __call__(self) -> Tensor:
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return self.file.read(self.offset, self.nbytes).view(self.dtype).reshape(self.shape)
