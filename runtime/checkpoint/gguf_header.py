"""A GGUF file's header (metadata and tensor table), parsed in one linear pass that bounds every count before using it.

The gguf package's reader maps the file and builds Python objects for whatever counts the header claims (2 M
one-byte metadata strings took 56 s and 3 GB, a claimed array length loops past the file's end), and transformers
reads through it. Here the header is read with plain reads into memory of its own, and before anything is built for
a count or a length it is checked against the bytes the file still holds and against `limits`. The rules are
llama.cpp's loader's (ggml/src/gguf.cpp) and the format's spec: version 2 or 3, little-endian, known value and GGML
type ids, no nested arrays, keys ASCII and unique, strings UTF-8, `general.alignment` a u32 power of two; tensor
names unique, non-empty, without NUL; at most 4 dimensions (none: a scalar) whose element count fits 63 bits, rows of
whole blocks; and
the tensors, in table order, back to back from the data section's start, each at the padded end of the one before,
within the file, with nothing after the last one's padding (stricter than both: a shrunken last tensor shows there).
Every problem is a `CheckpointError` naming the file and the field or tensor.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import gguf
import numpy as np

from . import limits
from .errors import CheckpointError

_SCALARS = {  # value type -> struct format
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d",
}
_INTEGERS = frozenset(t for t, f in _SCALARS.items() if f in "BbHhIiQq")
_SMALLEST_ITEM = 8  # a string's length field; every other value is at least one byte
_CHUNK = 1 << 20
_LISTING_CHUNK = 4096  # a listing reads a few short keys: one page, not a header's chunk


@dataclass(frozen=True)
class Strings:
    """A metadata array of strings, checked (UTF-8, within the file) but not kept: nothing Streamwise reads is one."""

    count: int


@dataclass(frozen=True)
class Value:
    """One metadata value: its GGUF type (an array's item type) and what it holds."""

    type: gguf.GGUFValueType
    value: object  # int, float, bool, str; an array: a numpy array of its numbers, or `Strings`
    array: bool = False

    @property
    def integers(self) -> list[int] | None:
        """The value as integers (a scalar as one), None when it is not of an integer type."""
        if self.type not in _INTEGERS:
            return None
        return [int(v) for v in self.value] if self.array else [int(self.value)]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order: the row length first
    qtype: gguf.GGMLQuantizationType
    offset: int  # from the data section's start
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Value]
    tensors: list[TensorInfo]
    data_start: int
    alignment: int


class _Cursor:
    """Reads the header forward, in chunks, never past the file's end nor `limits.MAX_GGUF_HEADER`."""

    def __init__(self, path, handle, size: int, chunk: int = _CHUNK) -> None:
        self.path, self.handle, self.size, self.chunk = path, handle, size, chunk
        self.buffer = bytearray()
        self.at = 0

    def left(self) -> int:
        return self.size - self.at

    def take(self, count: int, what: str) -> memoryview:
        end = self.at + count
        if end > self.size:
            raise self.error(f"truncated: {what} needs bytes up to {end}, the file has {self.size}")
        if end > limits.MAX_GGUF_HEADER:
            raise self.error(f"the metadata and tensor table run past {limits.MAX_GGUF_HEADER} bytes, the limit")
        if end > len(self.buffer):
            wanted = min(max(end - len(self.buffer), self.chunk), self.size - len(self.buffer))
            chunk = self.handle.read(wanted)
            self.buffer += chunk
            if len(self.buffer) < end:
                raise self.error(f"truncated while read: {what} needs bytes up to {end}")
        start, self.at = self.at, end
        return memoryview(self.buffer)[start:end]

    def unpack(self, form: str, what: str):
        return struct.unpack("<" + form, self.take(struct.calcsize(form), what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.unpack("Q", what)
        if length > self.left() or (limit is not None and length > limit):
            bound = f"the limit is {limit}" if limit is not None and length > limit else f"{self.left()} bytes follow"
            raise self.error(f"{what}: a string of {length} bytes; {bound}")
        raw = self.take(length, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def error(self, message: str) -> CheckpointError:
        return CheckpointError([f"{self.path}: not a readable GGUF file: {message}"])


def read_header(path, handle, size: int) -> GGUFHeader:
    """The header of the GGUF file `handle` reads (positioned at its start, `size` bytes long), checked in full."""
    cursor = _Cursor(path, handle, size)
    if cursor.unpack("I", "the magic") != gguf.GGUF_MAGIC:
        raise cursor.error("no GGUF magic at its start")
    version = cursor.unpack("I", "the version")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (2, 3):
            raise CheckpointError([f"{path}: a big-endian GGUF file; Streamwise reads little-endian GGUF only"])
        raise cursor.error(f"version {version}; llama.cpp and Streamwise read versions 2 and 3")
    tensor_count, key_count = cursor.unpack("Q", "the tensor count"), cursor.unpack("Q", "the key count")
    for count, limit, smallest, what in ((key_count, limits.MAX_GGUF_KEYS, 8 + 4 + 1, "metadata keys"),
                                         (tensor_count, limits.MAX_GGUF_TENSORS, 8 + 4 + 4 + 8, "tensors")):
        if count > limit:
            raise cursor.error(f"it claims {count} {what}; the limit is {limit}")
        if count * smallest > cursor.left():
            raise cursor.error(f"it claims {count} {what}, which need at least {count * smallest} bytes; "
                               f"{cursor.left()} follow")
    metadata: dict[str, Value] = {}
    items = 0
    for _ in range(key_count):
        key = cursor.string("a metadata key", limits.MAX_GGUF_KEY)
        if not key.isascii() or not key:
            raise cursor.error(f"metadata key {key!r}: keys are non-empty ASCII")
        if key in metadata:
            raise cursor.error(f"metadata key `{key}` appears twice")
        metadata[key], items = _value(cursor, key, items)
    alignment = _alignment(cursor, metadata)
    tensors = _tensor_table(cursor, tensor_count)
    data_start = cursor.at + -cursor.at % alignment
    if not tensors:  # a file without tensors (llama.cpp's vocab-only files) may end before its data's padding
        data_start = min(data_start, size)
    _check_layout(path, tensors, data_start, alignment, size)
    return GGUFHeader(metadata, tensors, data_start, alignment)


def leading_strings(path, keys: int = 8, longest: int = 256) -> dict[str, str]:
    """The short string values at the start of a GGUF's metadata, up to the first of another type or one longer than
    `longest` bytes, at most `keys`: what a model listing reads (gguf's writer puts the architecture first, and
    Streamwise the names of the files it carries next), where parsing whole headers (tokenizer arrays) takes seconds.
    Empty: not a readable GGUF."""
    found: dict[str, str] = {}
    try:
        with open(path, "rb") as handle:
            cursor = _Cursor(path, handle, os.fstat(handle.fileno()).st_size, chunk=_LISTING_CHUNK)
            if cursor.unpack("I", "the magic") != gguf.GGUF_MAGIC or cursor.unpack("I", "the version") not in (2, 3):
                return found
            cursor.unpack("Q", "the tensor count")
            for _ in range(min(cursor.unpack("Q", "the key count"), keys)):
                key = cursor.string("a metadata key", longest)
                if cursor.unpack("I", f"`{key}`'s type") != gguf.GGUFValueType.STRING:
                    break
                found[key] = cursor.string(f"metadata `{key}`", longest)
    except (OSError, CheckpointError):  # unreadable, or a value past what a listing reads: what came before it
        pass
    return found


def _value(cursor: _Cursor, key: str, items: int) -> tuple[Value, int]:
    kind = _value_type(cursor, cursor.unpack("I", f"`{key}`'s type"), key)
    if kind != gguf.GGUFValueType.ARRAY:
        return Value(kind, _scalar(cursor, kind, key)), items
    kind = _value_type(cursor, cursor.unpack("I", f"`{key}`'s item type"), key)
    if kind == gguf.GGUFValueType.ARRAY:
        raise cursor.error(f"metadata `{key}`: an array of arrays, which llama.cpp does not read")
    count = cursor.unpack("Q", f"`{key}`'s length")
    smallest = _SMALLEST_ITEM if kind == gguf.GGUFValueType.STRING else struct.calcsize(_SCALARS[kind])
    if count * smallest > cursor.left():
        raise cursor.error(f"metadata `{key}`: an array of {count} items needs at least {count * smallest} bytes; "
                           f"{cursor.left()} follow")
    items += count
    if items > limits.MAX_GGUF_ARRAY_ITEMS:
        raise cursor.error(f"metadata `{key}`: the metadata arrays hold more than {limits.MAX_GGUF_ARRAY_ITEMS} "
                           "items together; the limit is that")
    if kind == gguf.GGUFValueType.STRING:
        for index in range(count):
            cursor.string(f"metadata `{key}`[{index}]")
        return Value(kind, Strings(count), array=True), items
    form = _SCALARS[kind]
    raw = cursor.take(count * struct.calcsize(form), f"metadata `{key}`")
    return Value(kind, np.frombuffer(raw, dtype=np.dtype("<" + form)).copy(), array=True), items


def _value_type(cursor: _Cursor, raw: int, key: str) -> gguf.GGUFValueType:
    try:
        return gguf.GGUFValueType(raw)
    except ValueError:
        raise cursor.error(f"metadata `{key}`: unknown value type id {raw}") from None


def _scalar(cursor: _Cursor, kind: gguf.GGUFValueType, key: str) -> object:
    if kind == gguf.GGUFValueType.STRING:
        return cursor.string(f"metadata `{key}`")
    return cursor.unpack(_SCALARS[kind], f"metadata `{key}`")


def _alignment(cursor: _Cursor, metadata: dict[str, Value]) -> int:
    found = metadata.get(gguf.Keys.General.ALIGNMENT)
    if found is None:
        return gguf.GGUF_DEFAULT_ALIGNMENT
    if found.type != gguf.GGUFValueType.UINT32 or found.array:
        raise cursor.error(f"metadata `{gguf.Keys.General.ALIGNMENT}` must be a u32")
    alignment = found.value
    if alignment == 0 or alignment & (alignment - 1):
        raise cursor.error(f"metadata `{gguf.Keys.General.ALIGNMENT}` is {alignment}, not a power of two")
    return alignment


def _tensor_table(cursor: _Cursor, count: int) -> list[TensorInfo]:
    tensors, names = [], set()
    for index in range(count):
        name = cursor.string(f"tensor {index}'s name", limits.MAX_TENSOR_NAME)
        if not name or "\0" in name:
            raise cursor.error(f"tensor {index}: the name {name!r} is empty or holds a NUL byte")
        if name in names:
            raise cursor.error(f"tensor `{name}` appears twice in the tensor table")
        names.add(name)
        n_dims = cursor.unpack("I", f"tensor `{name}`'s dimension count")
        if n_dims > limits.MAX_GGUF_DIMS:
            raise cursor.error(f"tensor `{name}`: {n_dims} dimensions; llama.cpp reads at most {limits.MAX_GGUF_DIMS}")
        dims = struct.unpack(f"<{n_dims}Q", cursor.take(8 * n_dims, f"tensor `{name}`'s shape"))
        raw_type = cursor.unpack("I", f"tensor `{name}`'s type")
        offset = cursor.unpack("Q", f"tensor `{name}`'s data offset")
        problem, qtype, nbytes = _tensor_problem(list(dims), raw_type)
        if problem is not None:
            raise cursor.error(f"tensor `{name}`: {problem}")
        tensors.append(TensorInfo(name, dims, qtype, offset, nbytes))
    return tensors


def _tensor_problem(dims: list[int], raw_type: int):
    """(why a tensor's type and shape cannot be read, else None; its type; its size in bytes)."""
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        return f"unknown GGML type id {raw_type}", None, None
    if math.prod(d or 1 for d in dims) >= limits.MAX_ELEMENTS:
        return f"shape {dims} has more elements than 63 bits count", None, None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if dims and dims[0] % block_size:
        return (f"{qtype.name} rows hold whole blocks of {block_size} values, but shape {dims} has rows of "
                f"{dims[0]}"), None, None
    return None, qtype, math.prod(dims) // block_size * type_size


def _check_layout(path, tensors: list[TensorInfo], data_start: int, alignment: int, size: int) -> None:
    """Each tensor at the padded end of the one before, within the file, and nothing after the last one's padding."""
    problems, expected = [], 0
    for tensor in tensors:
        offset, problem = tensor.offset, None
        if offset % alignment:
            problem = f"data offset {offset} is not a multiple of general.alignment {alignment}"
        elif offset != expected:
            problem = (f"data offset {offset}, but the tensors before it end at {expected} (padded to {alignment}): "
                       f"it {'overlaps them' if offset < expected else 'leaves a hole'}, or a type or shape before it "
                       "does not match the data")
        elif data_start + offset + tensor.nbytes > size:
            problem = f"its {tensor.nbytes} bytes at data offset {offset} run past the end of the file"
        if problem is not None:
            problems.append(f"{path}: not a readable GGUF file: tensor `{tensor.name}`: {problem}")
        end = offset + tensor.nbytes  # from where this one claims to be, so one bad tensor does not blame the next
        expected = end + -end % alignment
    if not problems and tensors and size > data_start + expected:
        problems.append(f"{path}: not a readable GGUF file: {size - data_start - expected} bytes follow the last "
                        "tensor's padded data: a tensor's type or shape does not match its bytes")
    if problems:
        raise CheckpointError(problems)
