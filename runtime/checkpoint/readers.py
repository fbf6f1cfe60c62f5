"""Reading checkpoint files: `.safetensors` (one file or an HF shard folder) and `.gguf` (`gguf_reader`).

A header is checked in full before any tensor is placed, at least as strictly as the format's own library checks
it (a file the library accepts loads; one it refuses is refused here), because a tensor placed from a lying header
misreads another tensor's bytes. Headers are parsed in one linear pass whose every count is bounded first (`limits`).
Tensors are read into memory of their own when the loader asks (`checked_file`), or mapped only under a read lease
that copies them before anyone changes the file (`leased`): a loaded model does not depend on the file, and a file
that changed after its header was read is refused. GGUF tensors keep their raw
GGML blocks and quant type. Every problem is a `CheckpointError` that names the file, the tensor and the reason.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import torch

from . import limits
from .checked_file import CheckedFile, check_regular, file_type
from .errors import CheckpointError as CheckpointError  # re-exported: callers name it here
from .stored import Checkpoint, FileRange, StoredTensor
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
MAX_HEADER = limits.MAX_SAFETENSORS_HEADER
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_USIZE = 2**64  # the library reads sizes and offsets as 64-bit unsigned integers


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
        from .gguf_reader import read_gguf  # the gguf package (20 ms to import) only for a GGUF file

        return read_gguf(path)
    if path.suffix == ".safetensors":
        tensors, checked = _safetensors(path)
        return Checkpoint(str(path), tensors, "safetensors", file=checked)
    raise CheckpointError([f"{path}: not a checkpoint Streamwise reads (.safetensors, a shard index, .gguf)"])


def _sharded(index: Path) -> Checkpoint:
    """Each tensor from the shard the index names for it; a shard's tensor the index does not list is an error."""
    check_regular(index)
    try:
        with open(index, "rb") as handle:
            raw = handle.read(limits.MAX_INDEX_BYTES + 1)
        if len(raw) > limits.MAX_INDEX_BYTES:
            raise CheckpointError([f"{index}: a shard index over {limits.MAX_INDEX_BYTES} bytes, the limit"])
        weight_map = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError("`weight_map` must map tensor names to shard file names")
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError([f"{index}: not a shard index ({type(exc).__name__}: {exc})"]) from None
    shards = sorted(set(weight_map.values()))
    if len(shards) > limits.MAX_SHARDS:
        raise CheckpointError([f"{index}: names {len(shards)} shard files; the limit is {limits.MAX_SHARDS}"])
    tensors: dict[str, StoredTensor] = {}
    problems, missing = [], set()
    for name in shards:
        shard = index.parent / name
        refused = _shard_name_problem(name)
        if refused is None and file_type(shard) is None:
            refused = "is missing"
        if refused is not None:
            problems.append(f"{index}: shard {name!r} {refused}")
            missing.add(name)
            continue
        for tensor_name, stored in _safetensors(shard)[0].items():
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


def _safetensors(path: Path) -> tuple[dict[str, StoredTensor], CheckedFile]:
    check_regular(path)
    try:
        with open(path, "rb") as handle:
            checked = CheckedFile(path, handle)
            size = checked.size
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError([f"{path}: truncated before its header"])
            (header_size,) = struct.unpack("<Q", head)
            if header_size > min(size - 8, MAX_HEADER):
                raise CheckpointError([f"{path}: header claims {header_size} bytes but the file has {size} "
                                       f"(the format allows at most {MAX_HEADER})"])
            raw = handle.read(header_size)
            if len(raw) < header_size:
                raise checked.changed(f"it ends at byte {8 + len(raw)}, inside its header")
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError([f"{path}: not a readable safetensors file ({exc})"]) from None
    entries = _safetensors_header(path, raw, size - 8 - header_size)
    data_start = 8 + header_size
    checked.name_tensors({name: (data_start + begin, math.prod(shape) * dtype.itemsize)
                          for name, (dtype, shape, begin) in entries.items()})
    return {name: StoredTensor(name, str(path), shape, dtype, FileRange(checked, data_start + begin, dtype, shape))
            for name, (dtype, shape, begin) in entries.items()}, checked


def _safetensors_header(path: Path, raw: bytes, data_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """`name -> (dtype, shape, begin)` of a header the safetensors library would accept, else a CheckpointError.

    The library's rules (safetensors/src/tensor.rs): UTF-8 JSON holding one object; `__metadata__` null or
    a string-to-string map; each tensor `{dtype, shape, data_offsets}` with a known dtype and non-negative
    64-bit integers (never booleans, floats or strings); sorted by offsets, the tensors lie back to back
    from byte 0, each exactly as long as its shape and dtype say, and the last ends where the file does.
    Stricter than the library on purpose: a duplicate key anywhere, another key in a tensor's entry, a name that
    is empty, holds a NUL byte or is over `limits.MAX_TENSOR_NAME` bytes, and a shape whose element count (a
    zero-size dimension counted as 1) does not fit 63 bits are refused (the library keeps the last duplicate,
    ignores other keys and sizes a zero-element tensor of any dimensions as empty)."""
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
            _check_name(name)
            dtype_name, shape, offsets = _entry(info)
        except ValueError as exc:
            problems.append(f"{path}: tensor `{_clipped(name)}`: {exc}")
            if len(problems) > 100:  # a header of a million bad entries needs no million lines
                break
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
    """A JSON object that names no key twice (in one pass: a header may hold a million keys)."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"duplicate key `{_clipped(duplicate)}`")
    return found


def _check_name(name: str) -> None:
    """A tensor name the formats' libraries and llama.cpp can hold: non-empty, no NUL, bounded."""
    if not name or "\0" in name:
        raise ValueError(f"the name {_clipped(name)!r} is empty or holds a NUL byte")
    size = len(name.encode("utf-8"))
    if size > limits.MAX_TENSOR_NAME:
        raise ValueError(f"a name of {size} bytes; the limit is {limits.MAX_TENSOR_NAME}")


def _clipped(name: str) -> str:
    return name if len(name) <= 80 else f"{name[:77]}..."


def _no_constant(name: str):
    raise ValueError(f"`{name}` is not JSON")


def _serde_int(text: str) -> int | float:
    """JSON integers as serde reads them: `-0` is the float -0.0, which no size or offset may be."""
    if len(text) > 20:  # more digits than any 64-bit integer: never handed to int(), which is quadratic in them
        raise ValueError(f"an integer of {len(text)} digits does not fit 64 bits")
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
    if math.prod(d or 1 for d in shape) >= limits.MAX_ELEMENTS:
        raise ValueError(f"shape {_short(shape)} has more elements than 63 bits count (a zero-size dimension counted "
                         "as 1)")
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
