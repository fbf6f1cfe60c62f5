"""Reading checkpoint files without copying them: `.safetensors` (one file or an HF shard folder)
and `.gguf`.

Tensors come back as views of a private memory map, so a load touches each byte of the file
once and never holds a second full copy. GGUF tensors keep their raw GGML blocks and quant type.
A header is checked in full before any tensor is placed, at least as strictly as the format's own
library checks it (a file the library accepts loads; one it refuses is refused here), because a
view placed from a lying header aliases or misreads another tensor's bytes. Every problem is a
`CheckpointError` that names the file, the tensor and the reason.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from .weight_files import SHARD_INDEX as SHARD_INDEX  # re-exported: callers and tests name it here
from .weight_files import VARIANTS, NoWeights, is_shard_index, weights_file

# The safetensors library's dtypes and their sizes in bits (its `Dtype::bitsize`).
SAFETENSORS_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
# Those torch holds as whole-byte elements (older torch builds lack some; F4 and F6 pack values below a byte).
SAFETENSORS_DTYPES = {name: dtype for name, dtype in {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
    "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None), "U64": getattr(torch, "uint64", None),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None), "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
    "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
}.items() if dtype is not None}
MAX_HEADER = 100_000_000  # the safetensors library's limit
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_USIZE = 2**64  # the library reads sizes and offsets as 64-bit unsigned integers


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
    note: str | None = None  # why the values are not the file's own (dequantized and transformed on the way)


@dataclass
class Checkpoint:
    path: str
    tensors: dict[str, StoredTensor]
    kind: str  # "safetensors" or "gguf"
    architecture: str | None = None  # a GGUF's `general.architecture` ("streamwise" for files Streamwise writes)


def file_type(path: Path) -> int | None:
    """The `stat` file type of `path`, None where nothing is there; a path the system refuses (a name
    too long, a NUL byte) is a CheckpointError rather than the OSError or ValueError it raises."""
    try:
        return stat.S_IFMT(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CheckpointError([f"{str(path)!r}: not a usable path ({reason})"]) from None


def _regular(path: Path) -> None:
    """Refuse anything but a regular file before opening it: a FIFO would block the open forever."""
    kind = file_type(path)
    if kind is None:
        raise CheckpointError([f"{path}: no such file"])
    if kind != stat.S_IFREG:
        raise CheckpointError([f"{path}: not a regular file (a folder, pipe or device); a checkpoint must be a file"])


def open_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None) -> Checkpoint:
    """The checkpoint at `path`: a file, a shard index, or a folder holding one (`weight_files` says which file of a
    folder; `dtype` picks among variants such as `diffusion_pytorch_model.fp16.safetensors`)."""
    path = Path(path)
    if file_type(path) == stat.S_IFDIR:
        variant = VARIANTS.get(str(dtype).removeprefix("torch."))  # None for None
        try:
            path = path / weights_file(os.listdir(path), variant)
        except (NoWeights, OSError) as exc:
            raise CheckpointError([f"{path}: {exc}"]) from None
    if is_shard_index(path.name):
        return _sharded(path)
    if path.suffix == ".gguf":
        return Checkpoint(str(path), *_gguf(path))
    if path.suffix == ".safetensors":
        return Checkpoint(str(path), _safetensors(path), "safetensors")
    raise CheckpointError([f"{path}: not a checkpoint Streamwise reads (.safetensors, a shard index, .gguf)"])


def _sharded(index: Path) -> Checkpoint:
    """Each tensor from the shard the index names for it; a shard's tensor the index does not list is an error."""
    _regular(index)
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
        refused = _shard_name_problem(name)
        if refused is None and file_type(shard) is None:
            refused = "is missing"
        if refused is not None:
            problems.append(f"{index}: shard {name!r} {refused}")
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


def _shard_name_problem(name: str) -> str | None:
    """Why a shard name is not a plain file name in the index's folder (an index must not reach outside it)."""
    if "\0" in name:
        return "holds a NUL byte"
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return "is not a file name in the index's folder"
    return None


def _safetensors(path: Path) -> dict[str, StoredTensor]:
    _regular(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError([f"{path}: truncated before its header"])
            (header_size,) = struct.unpack("<Q", head)
            if header_size > min(size - 8, MAX_HEADER):
                raise CheckpointError([f"{path}: header claims {header_size} bytes but the file has {size} "
                                       f"(the format allows at most {MAX_HEADER})"])
            entries = _safetensors_header(path, handle.read(header_size), size - 8 - header_size)
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError([f"{path}: not a readable safetensors file ({exc})"]) from None
    data_start, tensors = 8 + header_size, {}
    for name, (dtype, shape, begin) in entries.items():
        tensors[name] = StoredTensor(name, str(path), shape, dtype, _view(mapped, dtype, shape, data_start + begin))
    return tensors


def _safetensors_header(path: Path, raw: bytes, data_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """`name -> (dtype, shape, begin)` of a header the safetensors library would accept, else a CheckpointError.

    The library's rules (safetensors/src/tensor.rs): UTF-8 JSON holding one object; `__metadata__` null or
    a string-to-string map; each tensor `{dtype, shape, data_offsets}` with a known dtype and non-negative
    64-bit integers (never booleans, floats or strings); sorted by offsets, the tensors lie back to back
    from byte 0, each exactly as long as its shape and dtype say, and the last ends where the file does.
    Stricter than the library on purpose: a duplicate key anywhere, or another key in a tensor's entry, is
    refused (the library keeps the last duplicate and ignores other keys)."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                            parse_int=_serde_int)
        json.dumps(header, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape, which serde refuses
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested header JSON
        raise CheckpointError([f"{path}: not a readable safetensors file (its header is not JSON the format "
                               f"allows: {exc})"]) from None
    if not isinstance(header, dict):
        raise CheckpointError([f"{path}: not a readable safetensors file (the header is not a JSON object)"])
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise CheckpointError([f"{path}: `__metadata__` must map strings to strings, not {_short(metadata)}"])
    problems, layout = [], []
    for name, info in header.items():
        try:
            dtype_name, shape, offsets = _entry(info)
        except ValueError as exc:
            problems.append(f"{path}: tensor `{name}`: {exc}")
            continue
        layout.append((offsets, name, dtype_name, shape))
    if problems:
        raise CheckpointError(problems)
    entries, end, previous = {}, 0, "the header"
    for (begin, stop), name, dtype_name, shape in sorted(layout):
        nbytes = _nbytes(dtype_name, shape)
        if stop < begin or begin != end:
            where = ("ends before it begins" if stop < begin else f"overlaps {previous}" if begin < end
                     else f"leaves {begin - end} bytes no tensor claims after {previous}")
            problems.append(f"{path}: tensor `{name}`: data_offsets [{begin}, {stop}] {where}; tensors lie back to "
                            "back from data byte 0, without overlaps or holes")
        elif isinstance(nbytes, str):
            problems.append(f"{path}: tensor `{name}`: {nbytes}")
        elif stop - begin != nbytes:
            problems.append(f"{path}: tensor `{name}`: data_offsets [{begin}, {stop}] hold {stop - begin} bytes, "
                            f"but {dtype_name}{list(shape)} needs {nbytes}")
        elif dtype_name not in SAFETENSORS_DTYPES:
            problems.append(f"{path}: tensor `{name}`: dtype {dtype_name} has no torch dtype Streamwise reads")
        else:
            entries[name] = (SAFETENSORS_DTYPES[dtype_name], shape, begin)
        end, previous = max(end, stop), f"`{name}`"
    if not problems and end != data_size:
        problems.append(f"{path}: the tensors end at data byte {end} but the file holds {data_size} bytes of data "
                        "(truncated, or bytes no tensor claims)")
    if problems:
        raise CheckpointError(problems)
    return entries


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key `{next(k for k in keys if keys.count(k) > 1)}`")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"`{name}` is not JSON")


def _serde_int(text: str) -> int | float:
    """JSON integers as serde reads them: `-0` is the float -0.0, which no size or offset may be."""
    return -0.0 if text == "-0" else int(text)


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _usize(value: object) -> bool:
    return type(value) is int and 0 <= value < _USIZE


def _entry(info: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """A tensor entry's dtype name, shape and offsets, typed as the library's serde types require."""
    if not isinstance(info, dict) or set(info) != _ENTRY_KEYS:
        found = sorted(info) if isinstance(info, dict) else _short(info)
        raise ValueError(f"an entry is an object with exactly the keys dtype, shape and data_offsets, not {found}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
        raise ValueError(f"unknown dtype {_short(dtype)}; the format's dtypes are {', '.join(SAFETENSORS_BITS)}")
    if not (isinstance(shape, list) and all(map(_usize, shape))):
        raise ValueError(f"shape must be a list of non-negative integers, not {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_usize, offsets))):
        raise ValueError(f"data_offsets must be two non-negative integers, not {_short(offsets)}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _nbytes(dtype_name: str, shape: tuple[int, ...]) -> int | str:
    """The bytes a tensor takes, or why it cannot be sized: overflow is checked per dimension, as the library does."""
    bits = 1
    for d in (*shape, SAFETENSORS_BITS[dtype_name]):
        bits *= d
        if bits >= _USIZE:
            return f"{dtype_name}{list(shape)} overflows a 64-bit size"
    if bits % 8:
        return f"{dtype_name}{list(shape)} does not fill whole bytes"
    return bits // 8


def _view(mapped, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> Callable[[], Tensor]:
    count = math.prod(shape)

    def read() -> Tensor:
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(shape)

    return read


class _GGUFReader(gguf.GGUFReader):
    """The gguf package's reader, held to the layout llama.cpp's loader requires (ggml/src/gguf.cpp).

    The package reads what the header claims: an offset that overlaps another tensor, skips bytes or is
    misaligned, and a changed type id (Q8_0 to Q4_0 reads fewer bytes), all load garbage. Here, before any
    tensor is built, each type id must be known, each row must hold whole blocks, the element count must
    fit 64 bits, and the tensors, in header order, must lie back to back from the data section's start,
    each at the `general.alignment` padded end of the one before (ggml's rule), within the file; the file
    may end no later than the last tensor's padding (stricter than both: a shrunken last tensor shows there).
    Every read stays inside the file, so a huge claimed count fails at the end of the file instead of
    looping over nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(path, "c")

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(f"truncated: a field needs bytes up to {end}, the file has {len(self.data)}")
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        problems, expected = [], 0
        for info in fields:
            _, name_data, _, dims, raw_type, relative = info.parts
            name = bytes(name_data).decode("utf-8")
            problem, nbytes = _gguf_tensor_problem([int(d) for d in dims], int(raw_type[0]))
            offset = int(relative[0])
            if problem is None and offset % self.alignment:
                problem = f"data offset {offset} is not a multiple of general.alignment {self.alignment}"
            elif problem is None and expected is not None and offset != expected:
                problem = (f"data offset {offset}, but the tensors before it end at {expected} (padded to "
                           f"{self.alignment}): it {'overlaps them' if offset < expected else 'leaves a hole'}, "
                           "or a type or shape before it does not match the data")
            if problem is None and start_offs + offset + nbytes > len(self.data):
                problem = f"its {nbytes} bytes at data offset {offset} run past the end of the file"
            if problem is not None:
                problems.append(f"{self.path}: not a readable GGUF file: tensor `{name}`: {problem}")
            # from where this one claims to be, so one bad tensor does not blame the ones after it
            expected = None if nbytes is None else offset + nbytes + -(offset + nbytes) % self.alignment
        if not problems and fields and len(self.data) > start_offs + expected:
            problems.append(f"{self.path}: not a readable GGUF file: {len(self.data) - start_offs - expected} bytes "
                            "follow the last tensor's padded data: a tensor's type or shape does not match its bytes")
        if problems:
            raise CheckpointError(problems)
        super()._build_tensors(start_offs, fields)


def _gguf_tensor_problem(dims: list[int], raw_type: int) -> tuple[str | None, int | None]:
    """Why a GGUF tensor's type and shape cannot be read, else (None, its size in bytes)."""
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        return f"unknown GGML type id {raw_type}", None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    count = math.prod(dims)
    if count >= 2**63:
        return f"shape {dims} has more elements than 64 bits count", None
    if dims and dims[0] % block_size:
        problem = f"{qtype.name} rows hold whole blocks of {block_size} values, but shape {dims} has rows of {dims[0]}"
        return problem, None
    return None, count // block_size * type_size


def _gguf(path: Path) -> tuple[dict[str, StoredTensor], str, str | None]:
    from ..quant.gguf_dequant import STORED_FLOATS

    _regular(path)
    try:
        reader = _GGUFReader(path)
        entries = list(reader.tensors)
    except CheckpointError:
        raise
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
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    return tensors, "gguf", architecture if isinstance(architecture, str) else None
