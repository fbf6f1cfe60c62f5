"""Dequantization of raw GGML blocks with plain torch ops (and, on the CPU, numba's fused kernels where installed).

GGUF weights are streamed to the compute device as their raw block bytes (a uint8 tensor, the
smallest thing to move) and expanded there, right before use. Every kernel is vectorized over
blocks, so it runs on CPU and CUDA alike, and is bit-exact with `gguf.quants.dequantize` for
float32 output: products are formed in float32 in the same order as the reference, with the float16
scales widened to float32 first. On the CPU NaN payloads match too; a GPU's arithmetic returns one
canonical NaN, so there NaNs match by place. The supported set is the one table at the end of this module.

The IQ, E2M1 and UE4M3 types decode through lookup tables read from the gguf package (its grids,
sign patterns and value tables), built once per device; each lookup fetches several values, since
a per-element gather is what makes lookup tables slow in torch on CPU.

The expansion is memory-bound, so kernels write the integer quants once into the float32 output
and scale it in place, and decode the few scale bytes of each block without narrow strided
slices, which torch runs slowly, in as few ops as they can: torch splits an op on a few hundred
thousand scales across its threads, and each split is a hand-off between them, which costs a
scheduler slice (milliseconds) while another process holds a core and libgomp's waiting threads
spin. The output is a fresh buffer on huge pages where the platform has them (see `huge_pages`).
On the CPU the twelve common types expand in one pass instead where numba is installed (`gguf_fused_cpu`), with
the same bits; on CUDA the legacy types and the K-quants in one Triton kernel each where Triton is installed
(`gguf_triton`), writing the compute dtype where it goes, with the same bits (NaNs by place).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import ModuleType

import gguf
import gguf.quants as reference
import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ...errors import Error
from ..engine.tracing import compiled_call, plain_call
from ..registry import Registry
from . import gguf_triton, huge_pages, numba_kernels

QType = gguf.GGMLQuantizationType

Kernel = Callable[[Tensor, Tensor], None]
#: A kernel per GGML type: (n_blocks, type_size) uint8 blocks -> fills a (n_blocks, block_size) float32 output.
#: Filled from the one table at the end of this module; extensions register more.
DEQUANTIZERS: Registry[Kernel] = Registry("GGUF dequantizer")
# Types stored as plain floats: their bytes are reinterpreted, not dequantized.
STORED_FLOATS: dict[QType, torch.dtype] = {
    QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16,
}


class UnsupportedQuantType(Error, ValueError):
    """A GGML type without a dequantizer here."""


class BadBlocks(Error, ValueError, TypeError):
    """Bytes that are no GGML blocks of the type and shape given (a ValueError, or a TypeError for a tensor that is
    not raw bytes, as these were before)."""


def check_blocks(qtype: QType, shape: tuple[int, ...], nbytes: int) -> int:
    """The number of blocks `nbytes` of `qtype` hold for `shape`; raises if this module cannot expand them."""
    if qtype not in DEQUANTIZERS and qtype not in STORED_FLOATS:
        supported = ", ".join(t.name for t in [*STORED_FLOATS, *DEQUANTIZERS])
        raise UnsupportedQuantType(f"no dequantizer for GGML type {qtype.name}; supported: {supported}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise BadBlocks(
            f"{qtype.name} rows hold whole blocks of {block_size} values, but shape {shape} has rows of {row}"
        )
    n_blocks = math.prod(shape) // block_size
    if nbytes != n_blocks * type_size:
        raise BadBlocks(f"{qtype.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, got {nbytes}")
    return n_blocks


def dequantize(
    blocks: Tensor, qtype: QType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
) -> Tensor:
    """Expand raw GGML block bytes into a `dtype` tensor of `shape` (torch order, the reverse of GGUF's ne), written
    into `out` (uint8 bytes on the blocks' device, at least the result's) where given.

    Values are computed in float32 and then cast; F32 bytes read as float32 come back as a view of `blocks`.
    """
    shape = tuple(shape)
    if blocks.dtype != torch.uint8:
        raise BadBlocks(f"GGML blocks must be a uint8 tensor of raw bytes, got {blocks.dtype}")
    n_blocks = check_blocks(qtype, shape, blocks.numel())
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    kernel = DEQUANTIZERS.get(qtype)

    if out is None and blocks.is_cuda and torch.compiler.is_compiling() and qtype in gguf_triton.types():
        cols = shape[-1] if shape else 1  # a compiled graph calls the Triton kernel as an operator
        return torch.ops.streamwise.gguf_expand(blocks, int(qtype), math.prod(shape) // cols, cols, dtype).view(shape)

    def result(dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        if out is None:
            return huge_pages.empty(shape, dtype, blocks.device)
        return out[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    if n_blocks == 0:
        return torch.empty(shape, dtype=dtype, device=blocks.device)
    blocks = blocks.reshape(n_blocks, type_size)
    if kernel is None:
        stored = _reinterpret(blocks, STORED_FLOATS[qtype]).reshape(shape)
        return stored if stored.dtype == dtype else result(dtype, shape).copy_(stored)
    if _fused_gpu(qtype, blocks):  # one kernel writing the compute dtype where it goes
        values = result(dtype, (n_blocks, block_size))
        if gguf_triton.dequantize(qtype, blocks, values):
            return values.view(shape)
    # float32 is computed where the result goes; another dtype from float32 of its own (the torch kernels' design)
    values = (result(torch.float32, (n_blocks, block_size)) if dtype == torch.float32
              else huge_pages.empty((n_blocks, block_size), torch.float32, blocks.device))
    fused = _fused_cpu(qtype, blocks)
    if fused is None:
        kernel(blocks, values)
    else:
        fused.dequantize(qtype, blocks.detach().contiguous().numpy(), values.numpy(), _CPU_TABLES["f16"].numpy())
    if dtype == torch.float32:
        return values.view(shape)
    return result(dtype, shape).copy_(values.view(shape))


def _fused_cpu(qtype: QType, blocks: Tensor) -> ModuleType | None:
    """`gguf_fused_cpu`, where it expands these blocks: on the CPU, outside a compiled graph and any other tracer (a
    dispatch mode: they record the torch kernels' ops, where a native call would leave an empty buffer in the
    trace), for the types it has, with numba installed and compiling (its kernels would run as Python without)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or not _on_cpu(blocks):
        return None
    fused = numba_kernels.fused_dequant()
    return fused if fused is not None and qtype in fused.TYPES else None


def gpu_matmul(rows: Tensor, blocks: Tensor, qtype: QType, out_features: int) -> Tensor | None:
    """`rows` (a few, on CUDA) times the weight these blocks hold, transposed, in float32, from the blocks directly
    (`gguf_triton.matmul`: decode expands no weight; in a compiled graph as its operator); None where that kernel
    does not serve (more rows, another device or type, a gradient or another tracer): the caller expands instead."""
    if rows.shape[0] > gguf_triton.MATMUL_ROWS or not blocks.is_cuda or qtype not in gguf_triton.types():
        return None
    if plain_call(rows):
        return gguf_triton.matmul(rows, blocks, qtype, out_features)
    if compiled_call(rows):
        return torch.ops.streamwise.gguf_decode(rows, blocks, int(qtype), out_features)
    return None


def _fused_gpu(qtype: QType, blocks: Tensor) -> bool:
    """Whether `gguf_triton` expands these blocks: on CUDA (never on a CPU, where Triton would run as its
    interpreter), outside a compiled graph and any other tracer, for the types it has, with Triton installed."""
    return (blocks.is_cuda and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and qtype in gguf_triton.types())


def _reinterpret(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """Bytes read as `dtype` along the last axis: a view where their layout and offset allow one, else a copy's.

    A compiled graph cannot read a storage offset; the blocks it dequantizes are residents', whose
    storage is aligned when they are made, so there only the layout is fixed.
    """
    if torch.compiler.is_compiling():
        return raw.contiguous().view(dtype)
    if not raw.is_contiguous() or raw.storage_offset() % dtype.itemsize:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(dtype)


def _half(blocks: Tensor, offset: int, count: int = 1) -> Tensor:
    """The `count` little-endian float16 from byte `offset` of every block (d, or d and dmin), widened to float32 of
    shape (n_blocks, count)."""
    words = _words(blocks, torch.int16) if offset % 2 == 0 else None
    if words is None:
        return _widen_half(_reinterpret(blocks[:, offset : offset + 2 * count], torch.int16))
    return _widen_half(words[:, offset // 2 : offset // 2 + count])


def _words(blocks: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The blocks read as `dtype` words, a view (no copy), or None where their size or layout does not allow one.

    Kernels read their fields as strided slices of it: a narrow slice of the bytes would be copied first.
    """
    if blocks.shape[-1] % dtype.itemsize:
        return None
    if torch.compiler.is_compiling() or (blocks.is_contiguous() and blocks.storage_offset() % dtype.itemsize == 0):
        return _reinterpret(blocks, dtype)
    return None


def _widen_half(bits: Tensor) -> Tensor:
    """float16 bits (int16, any layout) as float32.

    On the CPU, widened as numpy does (NaNs keep sign and payload, signalling ones too) by a gather from numpy's
    own widening of every half (a 256 KB table): torch's conversion returns one canonical NaN in its scalar path
    and quiets signalling NaNs in its vector path, and the gather takes two ops where rebuilding NaNs from the bits
    takes seven, each on a few hundred thousand scales a thread hand-off when torch splits it. Elsewhere torch
    converts, in one op: a GPU's arithmetic returns one canonical NaN, so no payload would survive the product
    every scale goes into, and each op there is a kernel launch, which is what a dequant of this size costs.
    """
    if _on_cpu(bits):
        index = bits.view(torch.uint16).int()  # zero-extended, and gathered from strided columns in the same op
        return _CPU_TABLES["f16"].index_select(0, index.view(-1)).view(bits.shape)
    return bits.view(torch.float16).float()


def _on_cpu(tensor: Tensor) -> bool:
    """Whether the CPU kernels apply: exact NaN payloads, and no op that casts its inputs (CPU elementwise ops cast
    mixed inputs through a temporary copy, where a GPU kernel converts each value as it loads it)."""
    return tensor.device.type == "cpu"


def _unpack(packed: Tensor, width: int, dim: int) -> Tensor:
    """Split each byte into its 8 // width fields of `width` bits, lowest first, along a new axis `dim`.

    On the CPU each field is computed whole and contiguous and the new axis is moved into place as a
    view, so the interleaving happens once, in the copy into the float output. Elsewhere every field
    is shifted out by one broadcast op against a table of shifts and masked by a second.
    """
    if not _on_cpu(packed):
        return _broadcast_fields(packed, width, 8 // width).movedim(-1, dim)
    mask = (1 << width) - 1
    packed = packed.contiguous()
    fields = huge_pages.empty((8 // width, *packed.shape), torch.uint8, packed.device)  # large: see huge_pages
    for index, field in enumerate(fields):
        shift = index * width
        if shift + width == 8:
            torch.bitwise_right_shift(packed, shift, out=field)
        else:
            torch.bitwise_and(packed >> shift if shift else packed, mask, out=field)
    return fields.movedim(0, dim)


def _broadcast_fields(packed: Tensor, width: int, count: int) -> Tensor:
    """The `count` fields of `width` bits of each integer of `packed`, lowest first, along a new last axis, in two
    ops whatever the count (off the CPU, where an op costs its launch): one shift against the shifts, one mask.
    The shifts come from a table made once per device, or, in a compiled graph, which reads no device's table
    without a break, are made there (a constant to the compiler)."""
    if torch.compiler.is_compiling():
        shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=packed.device)
    else:
        shifts = _table(f"shifts{width}", packed.device)[:count]
    return (packed.unsqueeze(-1) >> shifts).bitwise_and_((1 << width) - 1)


def _affine(out: Tensor, q: Tensor, scale: Tensor, offset: Tensor | None = None) -> None:
    """Fill `out` with float32(q) * scale (+ offset), in q's element order, in place.

    On the CPU the integers are copied into the output and scaled there; elsewhere the product converts them as it
    reads them, one op fewer over the float output, and reads q in whatever layout its fields were built in.
    """
    if _on_cpu(q):
        out.view(q.shape).copy_(q)
        _scale(out, scale, offset)
        return
    q, scale = _grouped(q, scale)
    values = out.view(q.shape)
    if torch.compiler.is_compiling():  # a graph writes no `out=` of another layout than its result's; fused there
        values.copy_(q * scale if offset is None else offset.view(scale.shape) + q * scale)
        return
    torch.mul(q, scale, out=values)
    if offset is not None:
        torch.add(offset.view(scale.shape), values, out=values)


def _grouped(q: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """q (n_blocks, ...) in value order, any layout, and its (n_blocks, groups) `scale`, as views that broadcast
    group by group: q's axes split where a group ends inside one, the scale's split to match, no copy."""
    groups, leading, axis = scale.shape[-1], 1, 1
    while leading < groups:
        if leading * q.shape[axis] > groups:
            q = q.unflatten(axis, (groups // leading, -1))
        leading *= q.shape[axis]
        axis += 1
    return q, scale.reshape(*q.shape[:axis], *[1] * (q.ndim - axis))


def _scale(out: Tensor, scale: Tensor, offset: Tensor | None = None) -> None:
    """Multiply each group of consecutive values of `out` by its term of `scale` (n_blocks, groups), in place,
    then add `offset` (same shape).

    The reference's `d * q + m` returns d * q's NaN when both are NaN (x86 keeps the first operand's);
    torch's add keeps the second's, so the sum is formed as `m + d * q`.
    """
    groups = out.view(*scale.shape, -1).mul_(scale.unsqueeze(-1))
    if offset is not None:
        torch.add(offset.unsqueeze(-1), groups, out=groups)


def _factor(ints: Tensor) -> Tensor:
    """Small integers ready to multiply a float scale: as float32 on the CPU, where a product of mixed types copies
    its integer operand first (slowly); elsewhere as they are, converted by the product as it reads them."""
    return ints.float() if _on_cpu(ints) else ints


def _minus(dmin: Tensor, m: Tensor) -> Tensor:
    """The reference's `- dmin * m` (m small unsigned integers) as a term to add, which adds as it subtracts:
    IEEE negation is exact, and a zero m gives the -0 the subtraction's +0 needs. On the CPU m is negated, so a NaN
    dmin passes through the product unchanged, sign included; elsewhere, where NaNs keep no payload, the few dmin
    are, and the product converts m as it reads it."""
    return dmin * m.float().neg_() if _on_cpu(m) else dmin.neg() * m


def _rows(blocks: Tensor, start: int, stop: int) -> Tensor:
    """Bytes `start:stop` of every block: copied whole on the CPU, whose ops run slowly on narrow strided slices;
    a view elsewhere, where an op reads any layout at its cost."""
    return blocks[:, start:stop].contiguous() if _on_cpu(blocks) else blocks[:, start:stop]


def _q8_0(blocks: Tensor, out: Tensor) -> None:
    """34 bytes: d (f16), 32 int8 quants."""
    _affine(out, blocks[:, 2:].view(torch.int8), _half(blocks, 0))


def _q4_0(blocks: Tensor, out: Tensor) -> None:
    """18 bytes: d (f16), 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31."""
    _affine(out, _nibbles(blocks, 2).view(torch.int8).sub_(8), _half(blocks, 0))


def _q4_1(blocks: Tensor, out: Tensor) -> None:
    """20 bytes: d (f16), m (f16), nibbles as in Q4_0; value = d * q + m."""
    d = _half(blocks, 0, 2)
    _affine(out, _nibbles(blocks, 4), d[:, :1], d[:, 1:])


def _nibbles(blocks: Tensor, start: int, high_offset: int | None = None) -> Tensor:
    """The 16 bytes at `start` of every block split into 32 nibbles, (n_blocks, 32) bytes: low nibbles are
    values 0-15, high ones 16-31; with `high_offset` (Q5_0/Q5_1), plus 16 times bit i of the little-endian u32
    in the preceding 4 bytes for value i, plus the offset (mod 256).

    On the CPU built eight values at a time in int64 words, one column of words (n_blocks long) per op: a
    block's fields are too narrow for ops along them; each byte of the u32 becomes its eight values' top bits,
    offset included, through a table (a byte -> eight bytes, as int64). Off the CPU, where an op costs its launch
    and not its width, the nibbles take three ops along the bytes, and the top bits are broadcast fields.
    """
    if not _on_cpu(blocks):
        qs = blocks[:, start : start + 16]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
        if high_offset is None:
            return q
        return torch.add(q, _unpack(blocks[:, start - 4 : start], 1, -1).flatten(1), alpha=16).add_(high_offset)
    n, device = blocks.shape[0], blocks.device
    words = _words(blocks, torch.int64) if start % 8 == 0 else None
    qs = _reinterpret(blocks[:, start : start + 16], torch.int64) if words is None else words[:, start // 8 :]
    q = huge_pages.empty((n, 4), torch.int64, device)
    if high_offset is None:
        for word in range(2):
            torch.bitwise_and(qs[:, word], _LOW_NIBBLES, out=q[:, word])
            torch.bitwise_right_shift(qs[:, word], 4, out=q[:, 2 + word]).bitwise_and_(_LOW_NIBBLES)
        return q.view(torch.uint8).view(n, 32)
    index = torch.empty((n, 4), dtype=torch.int32, device=device)
    for byte in range(4):
        index[:, byte].copy_(blocks[:, start - 4 + byte])
    torch.index_select(_table(f"q5_high{high_offset}", device), 0, index.view(-1), out=q.view(-1))
    for word in range(2):
        q[:, word].bitwise_or_(qs[:, word] & _LOW_NIBBLES)
        q[:, 2 + word].bitwise_or_((qs[:, word] >> 4).bitwise_and_(_LOW_NIBBLES))
    return q.view(torch.uint8).view(n, 32)


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F


def _q5_0(blocks: Tensor, out: Tensor) -> None:
    """22 bytes: d (f16), qh (4 bytes), 16 bytes of low nibbles; value = d * (q - 16). qh (little-endian
    u32) holds bit 4 of value i at bit i."""
    _affine(out, _nibbles(blocks, 6, -16).view(torch.int8), _half(blocks, 0))


def _q5_1(blocks: Tensor, out: Tensor) -> None:
    """24 bytes: d (f16), m (f16), qh (4 bytes), 16 bytes of low nibbles; value = d * q + m."""
    d = _half(blocks, 0, 2)
    _affine(out, _nibbles(blocks, 8, 0), d[:, :1], d[:, 1:])


def _q2_k(blocks: Tensor, out: Tensor) -> None:
    """84 bytes: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit quants, d, dmin.

    Each 32-byte half of the quants holds 128 values: 2-bit field j of byte i is value 32 * j + i.
    """
    scales, d = _rows(blocks, 0, 16), _half(blocks, 80, 2)
    dl = d[:, :1] * _factor(scales & 0xF)
    ml = _minus(d[:, 1:], scales >> 4)
    _affine(out, _unpack(blocks[:, 16:80].reshape(-1, 2, 32), 2, -2), dl, ml)


def _q3_k(blocks: Tensor, out: Tensor) -> None:
    """110 bytes: hmask (32), 2-bit quants (64, laid out as in Q2_K), 12 scale bytes, d (f16).

    Bit j of hmask byte i belongs to value 32 * j + i; a clear bit subtracts 4. The sixteen 6-bit
    scales keep their low 4 bits in the nibbles of bytes 0-7 (low nibbles first) and their top
    2 bits in the 2-bit fields of bytes 8-11 (field j of byte i is scale 4 * j + i).
    """
    _affine(out, _q3_k_quants(blocks), _half(blocks, 108) * _q3_k_scales(blocks[:, 96:108]))


def _q3_k_quants(blocks: Tensor) -> Tensor:
    """Q3_K's signed quants in value order, (n_blocks, 128-value half, field, byte).

    On the CPU built two bytes at a time in int16 words (every field stays inside its byte) as four planes, one
    per 2-bit field of the quant bytes, laid out as those are; the copy into the float output interleaves them.
    """
    if not _on_cpu(blocks):
        hmask = _unpack(blocks[:, :32], 1, -2).unflatten(1, (2, 4))
        low = _unpack(blocks[:, 32:96].unflatten(1, (2, 32)), 2, -2)
        return torch.add(low, hmask, alpha=4).view(torch.int8).sub_(4)
    n, device = blocks.shape[0], blocks.device
    words = _words(blocks, torch.int16)
    if words is None:
        words = _reinterpret(blocks.contiguous(), torch.int16)
    planes = huge_pages.empty((4, n, 2, 16), torch.int16, device)  # field, block, 128-value half, word
    qs = words[:, 16:48].view(n, 2, 16)
    planes[0].copy_(qs)
    for field in range(1, 4):
        torch.bitwise_right_shift(qs, 2 * field, out=planes[field])
    planes.bitwise_and_(0x0303)
    hmask = words[:, :16].contiguous().view(n, 1, 16)  # whole rows: cat interleaves contiguous inputs fastest
    halves = torch.cat([hmask, hmask >> 4], dim=1)  # the bits of the second half at those of the first
    high = huge_pages.empty((4, n, 2, 16), torch.int16, device)
    for field in range(4):  # hmask bit of field j to bit 2 of each byte
        shift = 2 - field
        if shift > 0:
            torch.bitwise_left_shift(halves, shift, out=high[field])
        elif shift < 0:
            torch.bitwise_right_shift(halves, -shift, out=high[field])
        else:
            high[field].copy_(halves)
    planes.bitwise_or_(high.bitwise_and_(0x0404))
    return planes.view(torch.int8).sub_(4).view(4, n, 2, 32).permute(1, 2, 0, 3)


def _q3_k_scales(packed: Tensor) -> Tensor:
    """Q3_K's sixteen signed 6-bit scales from its 12 scale bytes, (n_blocks, 16) `_factor`s.

    On the CPU four fields at a time in int32 words; elsewhere by broadcast fields.
    """
    if _on_cpu(packed):
        low, high = _reinterpret(packed.contiguous(), torch.int32).split([2, 1], -1)
        low = torch.cat([low, low >> 4], -1).bitwise_and_(0x0F0F0F0F)  # scales 0-3, 4-7, 8-11, 12-15
        high = torch.cat([high >> 2 * field for field in range(4)], -1)  # field j of 4 bytes at once
        low.bitwise_or_(high.bitwise_and_(0x03030303).bitwise_left_shift_(4))
        return low.view(torch.uint8).float().sub_(32)
    low = _unpack(packed[:, :8], 4, -2).unflatten(-1, (2, 4))  # scale 8 * nibble + byte
    high = _unpack(packed[:, 8:], 2, -2).unflatten(1, (2, 2))  # scale 4 * field + byte
    return (low | (high << 4)).view(torch.int8).sub_(32).flatten(1)


def _scale_min_k4(blocks: Tensor) -> Tensor:
    """Eight 6-bit scales and eight 6-bit mins of each Q4_K/Q5_K block, as (n_blocks, 2, 8) uint8: scales, mins.

    Of the 12 scale bytes, bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top
    2 bits of scales / mins 4-7 in their high 2 bits; bytes 8-11 hold the low 4 bits of scales 4-7
    (low nibble) and of mins 4-7 (high nibble). Each group of four bytes is handled as one
    little-endian 32-bit word, four fields at a time, scales and mins side by side, so the work runs along blocks
    in as few ops as there are steps.
    """
    words = _words(blocks, torch.int32)
    words = _reinterpret(blocks[:, 4:16], torch.int32) if words is None else words[:, 1:4]
    first, mixed = words[:, :2], words[:, 2:]  # (scales 0-3, mins 0-3); low bits of 4-7
    upper = torch.cat([mixed & 0x0F0F0F0F, (mixed >> 4) & 0x0F0F0F0F], -1).bitwise_or_((first >> 2) & 0x30303030)
    return torch.stack([first & 0x3F3F3F3F, upper], -1).view(torch.uint8)


def _k4_affine(blocks: Tensor, q: Tensor, out: Tensor) -> None:
    """d * scale * q - dmin * min over the eight 32-value sub-blocks of a Q4_K/Q5_K block."""
    scales, mins = _scale_min_k4(blocks).unbind(1)
    d = _half(blocks, 0, 2)
    _affine(out, q, d[:, :1] * _factor(scales), _minus(d[:, 1:], mins))


def _q4_k(blocks: Tensor, out: Tensor) -> None:
    """144 bytes: d, dmin (f16), 12 scale bytes, 128 bytes of nibbles.

    Each 32-byte chunk holds 64 values: low nibbles first, then high nibbles.
    """
    words = _words(blocks, torch.int32)
    if words is None:
        return _k4_affine(blocks, _unpack(blocks[:, 16:].reshape(-1, 4, 32), 4, -2), out)
    n = blocks.shape[0]
    nibbles = huge_pages.empty((2, n, 4, 8), torch.int32, blocks.device)  # low then high, four bytes a word
    qs = words[:, 4:].view(n, 4, 8)
    torch.bitwise_and(qs, 0x0F0F0F0F, out=nibbles[0])
    torch.bitwise_right_shift(qs, 4, out=nibbles[1]).bitwise_and_(0x0F0F0F0F)
    _k4_affine(blocks, nibbles.view(torch.uint8).view(2, n, 4, 32).permute(1, 2, 0, 3), out)


def _q5_k(blocks: Tensor, out: Tensor) -> None:
    """176 bytes: d, dmin (f16), 12 scale bytes, qh (32), 128 bytes of nibbles laid out as in Q4_K.

    Bit j of qh byte i is bit 4 of value 32 * j + i. On the CPU each bit j is moved to bit 4 of its byte for eight
    bytes at a time (an int64 word, one op per bit over the few words), so the top bits come out as the nibbles
    are laid out, runs of 32 values; elsewhere they are broadcast fields.
    """
    n = blocks.shape[0]
    ql = _unpack(blocks[:, 48:].reshape(-1, 4, 32), 4, -2)  # (block, chunk, nibble, byte): value 64c + 32nib + i
    if not _on_cpu(blocks):
        return _k4_affine(blocks, torch.add(ql, _unpack(blocks[:, 16:48], 1, -2).unflatten(1, (4, 2)), alpha=16), out)
    words = _words(blocks, torch.int64)
    qh = _reinterpret(blocks[:, 16:48], torch.int64) if words is None else words[:, 2:6].contiguous()
    high = huge_pages.empty((8, n, 4), torch.int64, blocks.device)  # bit, block, word
    for bit, plane in enumerate(high):
        if bit < 4:
            torch.bitwise_left_shift(qh, 4 - bit, out=plane)
        else:
            torch.bitwise_right_shift(qh, bit - 4, out=plane)
    high.bitwise_and_(0x1010101010101010)
    ql.movedim(-2, 0).bitwise_or_(high.view(torch.uint8).view(4, 2, n, 32).permute(1, 2, 0, 3))  # in ql's storage
    _k4_affine(blocks, ql, out)


def _q6_k(blocks: Tensor, out: Tensor) -> None:
    """210 bytes: ql (128), qh (64), 16 int8 scales, d (f16).

    Per 128-value half: nibble j of ql byte i (64 bytes) is value 64 * j + i, and 2-bit field j of
    qh byte i (32 bytes) is the top 2 bits of value 32 * j + i.
    """
    scales = _factor(_rows(blocks, 192, 208).view(torch.int8))
    _affine(out, _q6_k_quants(blocks), _half(blocks, 208) * scales)


def _q6_k_quants(blocks: Tensor) -> Tensor:
    """Q6_K's signed quants in value order, (n_blocks, half, nibble of ql, 32-value run, byte).

    On the CPU built two bytes at a time in int16 words (every field stays inside its byte) as two planes, one
    per nibble of ql, each laid out as ql is; the copy into the float output interleaves them. Elsewhere by
    broadcast fields: field j of qh is nibble j // 2, run j % 2.
    """
    if not _on_cpu(blocks):
        low = _unpack(blocks[:, :128].unflatten(1, (2, 64)), 4, -2).unflatten(-1, (2, 32))
        high = _unpack(blocks[:, 128:192].unflatten(1, (2, 32)), 2, -2).unflatten(2, (2, 2))
        return (low | (high << 4)).view(torch.int8).sub_(32)
    n, device = blocks.shape[0], blocks.device
    words = _words(blocks, torch.int16)
    if words is None:
        words = _reinterpret(blocks.contiguous(), torch.int16)
    ql, qh = words[:, :64].view(n, 2, 2, 16), words[:, 64:96].view(n, 2, 1, 16)
    planes = huge_pages.empty((2, n, 2, 2, 16), torch.int16, device)  # nibble, block, half, 32-value run, word
    high = huge_pages.empty((n, 2, 2, 16), torch.int16, device)  # qh by run: fields 2 * run at bits 0-1, 4-5
    qh = qh.contiguous()  # whole rows: cat, which interleaves contiguous inputs fastest, needs them
    torch.cat([qh, qh >> 2], dim=2, out=high)
    torch.bitwise_left_shift(high, 4, out=planes[0])  # fields 0, 1 to bits 4-5 of each byte
    planes[1].copy_(high)  # fields 2, 3 are there
    planes.bitwise_and_(0x3030)
    planes[0].bitwise_or_(torch.bitwise_and(ql, 0x0F0F, out=high))
    planes[1].bitwise_or_(torch.bitwise_right_shift(ql, 4, out=high).bitwise_and_(0x0F0F))
    return planes.view(torch.int8).sub_(32).view(2, n, 2, 2, 32).permute(1, 2, 0, 3, 4)


def _bits(word: Tensor, width: int, count: int) -> Tensor:
    """The `count` fields of `width` bits of each (int32) `word`, lowest first, along a new last axis."""
    if not _on_cpu(word):
        return _broadcast_fields(word, width, count)
    mask = (1 << width) - 1
    return torch.stack([(word >> (index * width)) & mask for index in range(count)], -1)


def _u16(blocks: Tensor, start: int, stop: int) -> Tensor:
    """The little-endian uint16 words of bytes `start:stop` of every block, as int32."""
    return _reinterpret(blocks[:, start:stop], torch.int16).int().bitwise_and_(0xFFFF)


# Lookup tables, read from the gguf package (grids, sign patterns, value tables) and built once per device.
# A per-element gather is slow on CPU, so each table answers several values per index: a grid row with its
# signs applied, or the values of four nibbles.


def _sign_patterns(bits: np.ndarray, width: int) -> np.ndarray:
    """(len(bits), width) float32 of +-1: bit j of bits[p] set negates value j."""
    set_bits = (bits.astype(np.uint32)[:, None] >> np.arange(width, dtype=np.uint32)) & 1
    return np.where(set_bits == 1, np.float32(-1), np.float32(1))


def _signed_grid(quant: type, patterns: np.ndarray) -> np.ndarray:
    """Row `p * rows + g`: grid row g (of patterns' width) with sign pattern p applied.

    Grid values are finite and nonzero, so negating one is exact, and `(d * g) * -1` is `d * -g` bit
    for bit (a NaN d passes through either product unchanged): the reference's sign multiply folds in.
    """
    quant.init_grid()
    grid = quant.grid.reshape(-1, patterns.shape[-1])
    return (patterns[:, None, :] * grid[None]).reshape(-1, grid.shape[-1])


_KSIGNS = np.frombuffer(reference.IQ2_XXS.ksigns, dtype=np.uint8)  # 7-bit index -> 8 sign bits (even parity)
_NIBBLE_SIGNS = _sign_patterns(np.arange(16), 4)


def _iq1_grid() -> np.ndarray:
    """Row `s * 2048 + g`: IQ1 grid row g plus delta, or minus it where the sign bit s is set."""
    reference.IQ1_S.init_grid()
    grid, delta = reference.IQ1_S.grid.reshape(-1, 8), reference.IQ1_S.delta
    return np.concatenate([grid + delta, grid - delta])


def _high_bits(offset: int) -> np.ndarray:
    """Index b -> eight bytes (one int64): byte m is 16 where bit m of b is set, plus `offset` (mod 256).

    With offset -16, ORing in a low nibble gives the signed value (nibble + 16 * bit) - 16 directly."""
    set_bits = (np.arange(256)[:, None] >> np.arange(8)) & 1
    return ((set_bits * 16 + offset) % 256).astype(np.uint8).view(np.int64)[:, 0]


def _nibble_pairs(values: tuple[int, ...]) -> np.ndarray:
    """Index `a | b << 4` -> float32 values[a], values[b] as one int64: two adjacent output values."""
    index = np.arange(256)
    return np.array(values, dtype=np.float32)[np.stack([index & 15, index >> 4], -1)].view(np.int64)[:, 0]


def _word_pairs(values: tuple[int, ...]) -> np.ndarray:
    """Index w, two bytes read as a little-endian word -> the values of their low nibbles as one int64; index
    65536 + w -> those of their high nibbles (a megabyte: the pairs a word of packed nibbles yields, no bit op)."""
    pairs, word = _nibble_pairs(values), np.arange(1 << 16)
    even, odd = word & 255, word >> 8
    return np.concatenate([pairs[(even & 15) | (odd & 15) << 4], pairs[(even >> 4) | (odd & 0xF0)]])


_NIBBLE_VALUES = {"iq4_nl": reference.IQ4_NL.kvalues, "mxfp4": reference.MXFP4.kvalues,
                  "nvfp4": reference.NVFP4.kvalues}
_TABLE_SOURCES: dict[str, Callable[[], np.ndarray]] = {
    "iq1": _iq1_grid,
    "iq2_xxs": lambda: _signed_grid(reference.IQ2_XXS, _sign_patterns(_KSIGNS, 8)),
    "iq2_xs": lambda: _signed_grid(reference.IQ2_XS, _sign_patterns(_KSIGNS, 8)),
    "iq2_s": lambda: _signed_grid(reference.IQ2_S, _NIBBLE_SIGNS),  # rows split in halves of 4 values
    # pattern 2 * s + h: the signs of half h of ksigns[s]
    "iq3_xxs": lambda: _signed_grid(reference.IQ3_XXS, _sign_patterns((_KSIGNS[:, None] >> [0, 4]).ravel() & 15, 4)),
    "iq3_s": lambda: _signed_grid(reference.IQ3_S, _NIBBLE_SIGNS),
    **{f"q5_high{offset}": functools.partial(_high_bits, offset) for offset in (0, -16)},
    **{name: functools.partial(_nibble_pairs, values) for name, values in _NIBBLE_VALUES.items()},
    **{f"{name}_words": functools.partial(_word_pairs, values) for name, values in _NIBBLE_VALUES.items()},
    # 2^(e - 128), a float32 subnormal for e < 2
    "e8m0": lambda: (np.where(np.arange(256) < 2, np.arange(256) + 1 << 21, np.arange(256) - 1 << 23)
                     .astype(np.int32).view(np.float32)),
    "ue4m3": lambda: reference.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)).astype(np.float32),
    "f16": lambda: np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),  # numpy's widening
    # uint8 shifts, so a shift keeps the width of what it shifts
    **{f"shifts{width}": functools.partial(np.arange, 0, 32, width, dtype=np.uint8) for width in (1, 2, 3, 4, 7)},
}
#: Read by the CPU kernels only: numpy's widening of every half, and the lookups by word (`_scaled_nibbles`).
_CPU_ONLY_TABLES = {"f16", *(f"{name}_words" for name in _NIBBLE_VALUES)}
#: Built at import (about 8 MB, a few ms): a compiled graph reads a module's tensor as a constant.
_CPU_TABLES = {name: torch.from_numpy(np.ascontiguousarray(source())) for name, source in _TABLE_SOURCES.items()}
_DEVICE_TABLES: dict[tuple[str, torch.device], Tensor] = {}


def prepare(device: torch.device) -> None:
    """What the kernels need on `device`, made once. Every lookup table they read is copied there (a few MB; on the
    CPU nothing is copied): a graph compiled there afterwards reads them as inputs, where one copied while it is
    traced would break it. On the CPU the fused kernels are loaded too (numba: 43 MiB, and compiling them the first
    time on a machine, 80 MiB more while it lasts), so that a load holds that memory before it reads its host budget."""
    if device.type == "cpu":
        numba_kernels.fused_dequant()
        numba_kernels.matmul()
    for name in _CPU_TABLES.keys() - _CPU_ONLY_TABLES:
        _device_table(name, device)


def _table(name: str, device: torch.device) -> Tensor:
    return _CPU_TABLES[name] if device.type == "cpu" else _device_table(name, device)


def _device_table(name: str, device: torch.device) -> Tensor:
    """Table `name` on `device`, copied there once. A compiled graph reads one copied before it was traced as an
    input; one not copied yet is copied outside the graph: a break, which that graph keeps."""
    if (name, device) in _DEVICE_TABLES:
        return _DEVICE_TABLES[name, device]
    return _copied_table(name, device)


@torch.compiler.disable
def _copied_table(name: str, device: torch.device) -> Tensor:
    table = _DEVICE_TABLES[name, device] = _CPU_TABLES[name].to(device)
    return table


def _lookup(name: str, index: Tensor, out: Tensor) -> None:
    """Fill `out` with the rows of table `name` that `index` picks, in index order, gathered straight into it."""
    table = _table(name, out.device)
    torch.index_select(table, 0, index.reshape(-1), out=out.view(-1, table.shape[-1]))


def _scaled_nibbles(qs: Tensor, name: str, scale: Tensor, out: Tensor) -> None:
    """Fill `out` (n_blocks, values) with table `name`'s values of the nibbles of qs (n_blocks, ..., k bytes)
    times `scale` (n_blocks, groups): of each k bytes, low nibbles are values 0..k-1, high ones k..2k-1.

    On the CPU each lookup writes two adjacent float32 values as one int64, indexed by a pair of bytes read as one
    word (their low nibbles' values, or, offset, their high nibbles'), so the gather lands in value order, a quarter
    as many indices are needed and no bit op splits a byte; the scale multiplies in place. Elsewhere each byte picks
    its low and high nibbles' values, and the product reads them in value order.
    """
    if not _on_cpu(qs):
        values = _table(name, qs.device).view(torch.float32).view(-1, 2).index_select(0, qs.int().view(-1))
        _affine(out, values.view(*qs.shape, 2).transpose(-1, -2), scale)
        return
    words = _reinterpret(qs.reshape(-1, qs.shape[-1]), torch.uint16)
    if torch.compiler.is_compiling():  # a graph takes no strided `out=`; fused there
        low = words.int()
        index = torch.cat([low, low + (1 << 16)], 1)
    else:
        index = torch.empty((words.shape[0], 2, words.shape[1]), dtype=torch.int32, device=qs.device)
        index[:, 0] = words  # zero-extended
        torch.add(index[:, 0], 1 << 16, out=index[:, 1])  # the high nibbles' half of the table
    torch.index_select(_table(f"{name}_words", qs.device), 0, index.view(-1), out=out.view(torch.int64).view(-1))
    _scale(out, scale)


def _iq_scale(d: Tensor, scale: Tensor, step: float) -> Tensor:
    """The reference's `d * (0.5 + scale) * step`, in its order."""
    return d * (scale.float() + 0.5) * step


def _iq2_xxs(blocks: Tensor, out: Tensor) -> None:
    """66 bytes: d (f16), then per 32 values two u32: four grid indices (bytes), and four 7-bit sign indices
    under a 4-bit scale; value = d * (0.5 + scale) / 4 * grid * signs."""
    aux = _reinterpret(blocks[:, 2:], torch.int32)[:, 1::2]
    grid = blocks[:, 2:].reshape(-1, 8, 8)[..., :4].int()
    _lookup("iq2_xxs", _bits(aux, 7, 4).mul_(256).add_(grid), out)
    _scale(out, _iq_scale(_half(blocks, 0), (aux >> 28) & 15, 0.25))


def _iq2_xs(blocks: Tensor, out: Tensor) -> None:
    """74 bytes: d (f16), 32 u16 (a 9-bit grid index under a 7-bit sign index, per 8 values), 8 bytes of
    4-bit scales (per 16 values). The table is laid out so that the u16 itself is the row."""
    _lookup("iq2_xs", _u16(blocks, 2, 66), out)
    _scale(out, _iq_scale(_half(blocks, 0), _unpack(blocks[:, 66:], 4, -1).flatten(1), 0.25))


def _pair_index(index: Tensor) -> Tensor:
    """Int32 table indices (…, 2) viewed as one int64 per pair, so a term both share is added once, elementwise.

    `_PAIR * t` adds t to both halves; indices are far below 2^31, so nothing carries between them.
    """
    return index.view(torch.int64).squeeze(-1)


_PAIR = 1 + (1 << 32)


def _iq2_s(blocks: Tensor, out: Tensor) -> None:
    """82 bytes: d (f16), 32 grid index low bytes, 32 sign bytes, 8 bytes of the indices' top 2 bits, 8 bytes
    of 4-bit scales (per 16 values). Grid rows are looked up in halves of 4, each with its 4 sign bits."""
    grid = blocks[:, 2:34].long().bitwise_or_(_unpack(blocks[:, 66:74], 2, -1).flatten(1).long() << 8)
    index = _unpack(blocks[:, 34:66], 4, -1).to(torch.int32, memory_format=torch.contiguous_format).mul_(2048)
    _pair_index(index).add_(grid.mul_(2 * _PAIR).add_(1 << 32))  # pattern (a sign nibble) * 2048 + 2 * grid + half
    _lookup("iq2_s", index, out)
    _scale(out, _iq_scale(_half(blocks, 0), _unpack(blocks[:, 74:], 4, -1).flatten(1), 0.25))


def _iq3_xxs(blocks: Tensor, out: Tensor) -> None:
    """98 bytes: d (f16), 64 grid indices (4 values each), 8 u32 of four 7-bit sign indices (per 8 values)
    under a 4-bit scale (per 32); value = d * (0.5 + scale) / 2 * grid * signs.

    The table's pattern 2 * s + h holds half h of sign index s, for the h-th grid row of its 8 values.
    """
    aux = _reinterpret(blocks[:, 66:], torch.int32)
    index = blocks[:, 2:66].int().view(-1, 8, 4, 2)
    _pair_index(index).add_(_bits(aux, 7, 4).long().mul_(512 * _PAIR).add_(256 << 32))
    _lookup("iq3_xxs", index, out)
    _scale(out, _iq_scale(_half(blocks, 0), (aux >> 28) & 15, 0.5))


def _iq3_s(blocks: Tensor, out: Tensor) -> None:
    """110 bytes: d (f16), 64 grid index low bytes (4 values each), 8 bytes of their 9th bits, 32 sign bytes
    (per 8 values), 4 bytes of 4-bit scales (per 32); value = d * (1 + 2 * scale) * grid * signs."""
    index = _unpack(blocks[:, 74:106], 4, -1).flatten(1).int().mul_(512)
    index.add_(blocks[:, 2:66].int()).add_(_unpack(blocks[:, 66:74], 1, -1).flatten(1).int() << 8)
    _lookup("iq3_s", index, out)
    _scale(out, _half(blocks, 0) * (_unpack(blocks[:, 106:], 4, -1).flatten(1) * 2 + 1))


def _iq1_s(blocks: Tensor, out: Tensor) -> None:
    """50 bytes: d (f16), 32 grid index low bytes (8 values each), 8 u16 (per 32 values): four 3-bit index
    tops, a 3-bit scale and delta's sign; value = d * (2 * scale + 1) * (grid +- 1/8)."""
    qh = _u16(blocks, 34, 50)
    top = _bits(qh, 3, 4).bitwise_or_(((qh >> 15) << 3).unsqueeze(-1))
    _lookup("iq1", top.mul_(256).add_(blocks[:, 2:34].reshape(-1, 8, 4)), out)
    _scale(out, _half(blocks, 0) * (((qh >> 12) & 7) * 2 + 1))


def _iq1_m(blocks: Tensor, out: Tensor) -> None:
    """56 bytes: 32 grid index low bytes (8 values each), 16 bytes of nibbles (3 index top bits and delta's
    sign, per 8 values), 4 u16 of four 3-bit scales (per 16 values) with d's f16 bits in their top nibbles."""
    _lookup("iq1", _unpack(blocks[:, 32:48], 4, -1).flatten(1).int().mul_(256).add_(blocks[:, :32]), out)
    words = _u16(blocks, 48, 56)
    d = torch.zeros_like(words[:, :1])
    for index in range(4):
        d |= (words[:, index : index + 1] >> 12) << (4 * index)
    d = _widen_half((d - ((d >> 15) << 16)).short())  # wrapped into int16's range first
    _scale(out, d * (_bits(words, 3, 4).flatten(1) * 2 + 1))


def _iq4_nl(blocks: Tensor, out: Tensor) -> None:
    """18 bytes: d (f16), 16 bytes whose low nibbles index values 0-15 and high nibbles 16-31 in a 16-value table."""
    _scaled_nibbles(blocks[:, 2:], "iq4_nl", _half(blocks, 0), out)


def _iq4_xs(blocks: Tensor, out: Tensor) -> None:
    """136 bytes: d (f16), a u16 of 2-bit scale tops, 4 bytes of 4-bit scale bottoms (per 32 values), then
    128 bytes laid out as eight IQ4_NL blocks without d; value = d * (scale - 32) * table value."""
    low = _unpack(blocks[:, 4:8], 4, -1).flatten(1)
    high = _unpack(blocks[:, 2:4], 2, -1).flatten(1)  # the u16's 2-bit fields, little-endian: bytes in order
    scale = (low | (high << 4)).view(torch.int8).sub_(32)
    _scaled_nibbles(blocks[:, 8:].unflatten(1, (8, 16)), "iq4_nl", _half(blocks, 0) * _factor(scale), out)


def _mxfp4(blocks: Tensor, out: Tensor) -> None:
    """17 bytes: an E8M0 exponent e, 16 bytes of E2M1 nibbles (doubled, as ggml keeps them), low then high;
    value = 2^(e - 128) * kvalue."""
    scale = _table("e8m0", blocks.device).index_select(0, blocks[:, 0].int())
    _scaled_nibbles(blocks[:, 1:], "mxfp4", scale.unsqueeze(-1), out)


def _nvfp4(blocks: Tensor, out: Tensor) -> None:
    """36 bytes: four UE4M3 scales (per 16 values), then per 16 values 8 bytes of E2M1 nibbles, low then high."""
    scale = _table("ue4m3", blocks.device).index_select(0, blocks[:, :4].reshape(-1).int())
    _scaled_nibbles(blocks[:, 4:].unflatten(1, (4, 8)), "nvfp4", scale.view(-1, 4), out)


def _tq1_0(blocks: Tensor, out: Tensor) -> None:
    """54 bytes: 48 bytes of five base-3 digits each, 4 bytes of four, d (f16) at 52. A byte b keeps its digits
    as a fixed-point fraction: with x = b * 3^k mod 256, digit k is (3x) >> 8, and value d * (digit - 1).
    Digit k of each byte of a run is value k * run + byte: runs of 32, 16, 4.

    All in uint8, which torch runs fastest: (3x) >> 8 is (3 * (x >> 2) + (3 * (x & 3)) >> 2) >> 6, exactly
    (x >> 2 loses a fraction below 3/4, which cannot reach the next multiple of 64), and nothing overflows.
    """
    n = blocks.shape[0]
    x = huge_pages.empty((n, 256), torch.uint8, blocks.device)
    for start, stop, count, first in ((0, 32, 5, 0), (32, 48, 5, 160), (48, 52, 4, 240)):
        digits = x[:, first : first + count * (stop - start)].view(n, count, -1)
        digits[:, 0] = blocks[:, start:stop]
        for k in range(1, count):  # b * 3^k mod 256, a wrapping uint8 product at a time
            digits[:, k] = digits[:, k - 1] * 3
    digit = torch.bitwise_right_shift(x, 2).mul_(3).add_(x.bitwise_and_(3).mul_(3).bitwise_right_shift_(2))
    _affine(out, digit.bitwise_right_shift_(6).sub_(1).view(torch.int8), _half(blocks, 52))


def _tq2_0(blocks: Tensor, out: Tensor) -> None:
    """66 bytes: 64 bytes of 2-bit fields laid out as Q2_K's quants, d (f16) at 64; value = d * (field - 1)."""
    _affine(out, _unpack(blocks[:, :64].reshape(-1, 2, 32), 2, -2).view(torch.int8).sub_(1), _half(blocks, 64))


#: Every GGML type dequantized here (the stored floats, F32/F16/BF16, are in STORED_FLOATS).
for _qtype, _kernel in {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.IQ1_S: _iq1_s,
    QType.IQ1_M: _iq1_m,
    QType.IQ2_XXS: _iq2_xxs,
    QType.IQ2_XS: _iq2_xs,
    QType.IQ2_S: _iq2_s,
    QType.IQ3_XXS: _iq3_xxs,
    QType.IQ3_S: _iq3_s,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
    QType.TQ1_0: _tq1_0,
    QType.TQ2_0: _tq2_0,
    QType.MXFP4: _mxfp4,
    QType.NVFP4: _nvfp4,
}.items():
    DEQUANTIZERS.register(_qtype, _kernel)
