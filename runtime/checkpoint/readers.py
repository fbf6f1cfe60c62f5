"""Reading checkpoint files without copying them: `.safetensors` (one file or an HF shard folder)
and `.gguf`.

Tensors come back as views of a private memory map, so a load touches each byte of the file
once and never holds a second full copy. GGUF tensors keep their raw GGML blocks and quant type.
Every problem (a truncated file, a corrupt header, a tensor whose bytes do not fit its shape)
is a `CheckpointError` that names the file and the tensor.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SHARD_INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not fit the model; `problems` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__("\n".join(shown))


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint: its logical shape, storage dtype, GGUF quant type if any."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], Tensor] = field(repr=False, compare=False)
    qtype: object = None  # the gguf.GGMLQuantizationType of a quantized GGUF tensor


@dataclass
class Checkpoint:
    path: str
    tensors: dict[str, StoredTensor]
    kind: str  # "safetensors" or "gguf"


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    if path.is_dir():
        index = path / SHARD_INDEX
        if index.is_file():
            return _sharded(index)
        singles = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.gguf"))
        if len(singles) != 1:
            raise CheckpointError(
                [f"{path}: expected `{SHARD_INDEX}`, or one .safetensors or .gguf file, in the folder"]
            )
        path = singles[0]
    if path.name.endswith(".index.json"):
        return _sharded(path)
    if path.suffix == ".gguf":
        return Checkpoint(str(path), _gguf(path), "gguf")
    if path.suffix == ".safetensors":
        return Checkpoint(str(path), _safetensors(path), "safetensors")
    raise CheckpointError([f"{path}: not a checkpoint Streamwise reads (.safetensors, a shard index, .gguf)"])


def _sharded(index: Path) -> Checkpoint:
    """Each tensor from the shard the index names for it; a shard's tensor the index does not list is an error."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError("`weight_map` must map tensor names to shard file names")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError([f"{index}: not a shard index ({type(exc).__name__}: {exc})"]) from None
    tensors: dict[str, StoredTensor] = {}
    problems, missing = [], set()
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if Path(name).name != name or not shard.is_file():
            problems.append(f"{index}: shard `{name}` is missing")
            missing.add(name)
            continue
        for tensor_name, stored in _safetensors(shard).items():
            listed = weight_map.get(tensor_name)
            if listed == name:
                tensors[tensor_name] = stored
            elif listed is None:
                problems.append(f"{shard}: tensor `{tensor_name}` is not listed in the index")
    problems += [f"{index}: tensor `{n}` is listed but its shard `{f}` lacks it"
                 for n, f in weight_map.items() if n not in tensors and f not in missing]
    if problems:
        raise CheckpointError(problems)
    return Checkpoint(str(index), tensors, "safetensors")


def _safetensors(path: Path) -> dict[str, StoredTensor]:
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError([f"{path}: truncated before its header"])
            (header_size,) = struct.unpack("<Q", head)
            if header_size > min(size - 8, _MAX_HEADER):
                raise CheckpointError([f"{path}: header claims {header_size} bytes but the file has {size}"])
            header = json.loads(handle.read(header_size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except CheckpointError:
        raise
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: absurdly nested header JSON
        raise CheckpointError([f"{path}: not a readable safetensors file ({exc})"]) from None
    data_start, tensors, problems = 8 + header_size, {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
            count = 1
            for d in shape:
                count *= d
            if (min(shape, default=0) < 0 or end - begin != count * dtype.itemsize
                    or begin < 0 or data_start + end > size):
                raise ValueError(
                    f"its {end - begin} bytes at {begin} do not hold {info['dtype']}{list(shape)} inside the file"
                )
        except (KeyError, TypeError, ValueError) as exc:
            detail = exc if isinstance(exc, ValueError) else f"malformed entry {info!r}"
            problems.append(f"{path}: tensor `{name}`: {detail}")
            continue
        view = _view(mapped, dtype, count, data_start + begin, shape)
        tensors[name] = StoredTensor(name, str(path), shape, dtype, view)
    if problems:
        raise CheckpointError(problems)
    return tensors


def _view(mapped, dtype: torch.dtype, count: int, offset: int, shape: tuple[int, ...]) -> Callable[[], Tensor]:
    def read() -> Tensor:
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(shape)

    return read


def _gguf(path: Path) -> dict[str, StoredTensor]:
    import gguf

    from ..quant.gguf_dequant import STORED_FLOATS

    try:
        reader = gguf.GGUFReader(path, "c")
        entries = list(reader.tensors)
    except Exception as exc:  # the gguf reader signals corruption with many exception types
        raise CheckpointError([f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})"]) from None
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise CheckpointError([f"{path}: a big-endian GGUF file; Streamwise reads little-endian GGUF only"])
    tensors = {}
    plain = {  # stored as they compute: never residents, read as views of the file
        **STORED_FLOATS,
        gguf.GGMLQuantizationType.F64: torch.float64, gguf.GGMLQuantizationType.I8: torch.int8,
        gguf.GGMLQuantizationType.I16: torch.int16, gguf.GGMLQuantizationType.I32: torch.int32,
        gguf.GGMLQuantizationType.I64: torch.int64,
    }
    for entry in entries:
        qtype = gguf.GGMLQuantizationType(entry.tensor_type)
        shape = tuple(int(d) for d in reversed(entry.shape.tolist()))
        data = entry.data
        if qtype in plain:
            def read(data=data, shape=shape, dtype=plain[qtype]):
                return torch.from_numpy(data).view(dtype).reshape(shape)

            tensors[entry.name] = StoredTensor(entry.name, str(path), shape, plain[qtype], read)
        else:
            def read(data=data):
                return torch.from_numpy(data).view(torch.uint8).reshape(-1)

            tensors[entry.name] = StoredTensor(entry.name, str(path), shape, torch.uint8, read, qtype)
    return tensors
