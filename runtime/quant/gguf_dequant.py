"""Dequantization of raw GGML blocks with plain torch ops.

GGUF weights are streamed to the compute device as their raw block bytes (a uint8 tensor, the
smallest thing to move) and expanded there, right before use. Every kernel is vectorized over
blocks, so it runs on CPU and CUDA alike, and is bit-exact with `gguf.quants.dequantize` for
float32 output: products are formed in float32 in the same order as the reference, with the
float16 scales widened to float32 first.

The expansion is memory-bound, so kernels write the integer quants once into the float32 output
and scale it in place, and decode the few scale bytes of each block without narrow strided
slices, which torch runs slowly. The output is a fresh buffer on huge pages where the platform
has them (see `huge_pages`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gguf
import torch
from torch import Tensor

from ..registry import Registry
from . import huge_pages

QType = gguf.GGMLQuantizationType

Kernel = Callable[[Tensor, Tensor], None]
#: A kernel per GGML type: (n_blocks, type_size) uint8 blocks -> fills a (n_blocks, block_size) float32 output.
DEQUANTIZERS: Registry[Kernel] = Registry("GGUF dequantizer")
dequantizer = DEQUANTIZERS.decorator
# Types stored as plain floats: their bytes are reinterpreted, not dequantized.
STORED_FLOATS: dict[QType, torch.dtype] = {
    QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16,
}


class UnsupportedQuantType(ValueError):
    """A GGML type without a dequantizer here."""


def check_blocks(qtype: QType, shape: tuple[int, ...], nbytes: int) -> int:
    """The number of blocks `nbytes` of `qtype` hold for `shape`; raises if this module cannot expand them."""
    if qtype not in DEQUANTIZERS and qtype not in STORED_FLOATS:
        supported = ", ".join(t.name for t in [*STORED_FLOATS, *DEQUANTIZERS])
        raise UnsupportedQuantType(f"no dequantizer for GGML type {qtype.name}; supported: {supported}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ValueError(
            f"{qtype.name} rows hold whole blocks of {block_size} values, but shape {shape} has rows of {row}"
        )
    n_blocks = math.prod(shape) // block_size
    if nbytes != n_blocks * type_size:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, got {nbytes}")
    return n_blocks


def dequantize(
    blocks: Tensor, qtype: QType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Tensor:
    """Expand raw GGML block bytes into a `dtype` tensor of `shape` (torch order, the reverse of GGUF's ne).

    Values are computed in float32 and then cast; F32 bytes read as float32 come back as a view of `blocks`.
    """
    shape = tuple(shape)
    if blocks.dtype != torch.uint8:
        raise TypeError(f"GGML blocks must be a uint8 tensor of raw bytes, got {blocks.dtype}")
    n_blocks = check_blocks(qtype, shape, blocks.numel())
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    kernel = DEQUANTIZERS.get(qtype)
    if n_blocks == 0:
        return torch.empty(shape, dtype=dtype, device=blocks.device)
    blocks = blocks.reshape(n_blocks, type_size)
    if kernel is None:
        return _reinterpret(blocks, STORED_FLOATS[qtype]).reshape(shape).to(dtype)
    values = huge_pages.empty((n_blocks, block_size), torch.float32, blocks.device)
    kernel(blocks, values)
    if dtype == torch.float32:
        return values.view(shape)
    return huge_pages.empty(shape, dtype, blocks.device).copy_(values.view(shape))


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


def _half(blocks: Tensor, offset: int) -> Tensor:
    """The little-endian float16 at byte `offset` of every block, widened to float32 of shape (n_blocks, 1)."""
    return _reinterpret(blocks[:, offset : offset + 2], torch.float16).float()


def _unpack(packed: Tensor, width: int, dim: int) -> Tensor:
    """Split each byte into its 8 // width fields of `width` bits, lowest first, along a new axis `dim`.

    Each field is computed whole and contiguous and the new axis is moved into place as a view, so
    the interleaving happens once, in the copy into the float output.
    """
    packed = packed.contiguous()
    mask = (1 << width) - 1
    fields = packed.new_empty((8 // width, *packed.shape))
    for index, field in enumerate(fields):
        shift = index * width
        if shift + width == 8:
            torch.bitwise_right_shift(packed, shift, out=field)
        else:
            torch.bitwise_and(packed >> shift if shift else packed, mask, out=field)
    return fields.movedim(0, dim)


def _affine(out: Tensor, q: Tensor, scale: Tensor, offset: Tensor | None = None) -> None:
    """Fill `out` with float32(q) * scale (+ offset), in q's element order, in place.

    `scale` and `offset` are (n_blocks, groups): one term per group of consecutive values. The
    reference's `scale * q - m` is the same float as `scale * q + (-m)`, so callers negate m.
    """
    out.view(q.shape).copy_(q)
    groups = out.view(*scale.shape, -1).mul_(scale.unsqueeze(-1))
    if offset is not None:
        groups.add_(offset.unsqueeze(-1))


@dequantizer(QType.Q8_0)
def _q8_0(blocks: Tensor, out: Tensor) -> None:
    """34 bytes: d (f16), 32 int8 quants."""
    _affine(out, blocks[:, 2:].view(torch.int8), _half(blocks, 0))


@dequantizer(QType.Q4_0)
def _q4_0(blocks: Tensor, out: Tensor) -> None:
    """18 bytes: d (f16), 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31."""
    _affine(out, _unpack(blocks[:, 2:], 4, -2).view(torch.int8).sub_(8), _half(blocks, 0))


@dequantizer(QType.Q4_1)
def _q4_1(blocks: Tensor, out: Tensor) -> None:
    """20 bytes: d (f16), m (f16), nibbles as in Q4_0; value = d * q + m."""
    _affine(out, _unpack(blocks[:, 4:], 4, -2), _half(blocks, 0), _half(blocks, 2))


def _q5(blocks: Tensor) -> Tensor:
    """The 5-bit quants of a Q5_0/Q5_1 block: qh (little-endian u32) holds bit 4 of value i at bit i."""
    qh = _unpack(blocks[:, :4], 1, -1).reshape(-1, 32)
    ql = _unpack(blocks[:, 4:], 4, -2).reshape(-1, 32)
    return ql.bitwise_or_(qh.bitwise_left_shift_(4))


@dequantizer(QType.Q5_0)
def _q5_0(blocks: Tensor, out: Tensor) -> None:
    """22 bytes: d (f16), qh (4 bytes), 16 bytes of low nibbles."""
    _affine(out, _q5(blocks[:, 2:]).view(torch.int8).sub_(16), _half(blocks, 0))


@dequantizer(QType.Q5_1)
def _q5_1(blocks: Tensor, out: Tensor) -> None:
    """24 bytes: d (f16), m (f16), qh (4 bytes), 16 bytes of low nibbles; value = d * q + m."""
    _affine(out, _q5(blocks[:, 4:]), _half(blocks, 0), _half(blocks, 2))


@dequantizer(QType.Q2_K)
def _q2_k(blocks: Tensor, out: Tensor) -> None:
    """84 bytes: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit quants, d, dmin.

    Each 32-byte half of the quants holds 128 values: 2-bit field j of byte i is value 32 * j + i.
    """
    scales = blocks[:, :16].contiguous()
    dl = _half(blocks, 80) * (scales & 0xF)
    ml = _half(blocks, 82) * (scales >> 4)
    _affine(out, _unpack(blocks[:, 16:80].reshape(-1, 2, 32), 2, -2), dl, ml.neg_())


@dequantizer(QType.Q3_K)
def _q3_k(blocks: Tensor, out: Tensor) -> None:
    """110 bytes: hmask (32), 2-bit quants (64, laid out as in Q2_K), 12 scale bytes, d (f16).

    Bit j of hmask byte i belongs to value 32 * j + i; a clear bit subtracts 4. The sixteen 6-bit
    scales keep their low 4 bits in the nibbles of bytes 0-7 (low nibbles first) and their top
    2 bits in the 2-bit fields of bytes 8-11 (field j of byte i is scale 4 * j + i).
    """
    low = _unpack(blocks[:, 96:104], 4, -2).reshape(-1, 16)
    high = _unpack(blocks[:, 104:108], 2, -2).reshape(-1, 16)
    scale = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    ql = _unpack(blocks[:, 32:96].reshape(-1, 2, 32), 2, -2).view(torch.int8)
    qh = _unpack(blocks[:, :32], 1, -2).bitwise_xor_(1).bitwise_left_shift_(2).view(torch.int8)
    _affine(out, ql.sub_(qh.view(ql.shape)), _half(blocks, 108) * scale)


def _scale_min_k4(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Eight 6-bit scales and eight 6-bit mins of each Q4_K/Q5_K block, as (n_blocks, 8) uint8 each.

    Of the 12 scale bytes, bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top
    2 bits of scales / mins 4-7 in their high 2 bits; bytes 8-11 hold the low 4 bits of scales 4-7
    (low nibble) and of mins 4-7 (high nibble). Each group of four bytes is handled as one
    little-endian 32-bit word, four fields at a time, so the work runs along blocks.
    """
    sc, mn, mixed = _reinterpret(blocks[:, 4:16], torch.int32).unbind(-1)
    scale = torch.stack([sc & 0x3F3F3F3F, (mixed & 0x0F0F0F0F) | ((sc >> 2) & 0x30303030)], -1)
    minimum = torch.stack([mn & 0x3F3F3F3F, ((mixed >> 4) & 0x0F0F0F0F) | ((mn >> 2) & 0x30303030)], -1)
    return scale.view(torch.uint8), minimum.view(torch.uint8)


def _k4_affine(blocks: Tensor, q: Tensor, out: Tensor) -> None:
    """d * scale * q - dmin * min over the eight 32-value sub-blocks of a Q4_K/Q5_K block."""
    scale, minimum = _scale_min_k4(blocks)
    _affine(out, q, _half(blocks, 0) * scale, (_half(blocks, 2) * minimum).neg_())


@dequantizer(QType.Q4_K)
def _q4_k(blocks: Tensor, out: Tensor) -> None:
    """144 bytes: d, dmin (f16), 12 scale bytes, 128 bytes of nibbles.

    Each 32-byte chunk holds 64 values: low nibbles first, then high nibbles.
    """
    _k4_affine(blocks, _unpack(blocks[:, 16:].reshape(-1, 4, 32), 4, -2), out)


@dequantizer(QType.Q5_K)
def _q5_k(blocks: Tensor, out: Tensor) -> None:
    """176 bytes: d, dmin (f16), 12 scale bytes, qh (32), 128 bytes of nibbles laid out as in Q4_K.

    Bit j of qh byte i is bit 4 of value 32 * j + i.
    """
    ql = _unpack(blocks[:, 48:].reshape(-1, 4, 32), 4, -2)
    qh = _unpack(blocks[:, 16:48], 1, -2).view(ql.shape)
    _k4_affine(blocks, ql.bitwise_or_(qh.bitwise_left_shift_(4)), out)


@dequantizer(QType.Q6_K)
def _q6_k(blocks: Tensor, out: Tensor) -> None:
    """210 bytes: ql (128), qh (64), 16 int8 scales, d (f16).

    Per 128-value half: nibble j of ql byte i (64 bytes) is value 64 * j + i, and 2-bit field j of
    qh byte i (32 bytes) is the top 2 bits of value 32 * j + i. Both are viewed as (half, 64-value
    run, 32-value run, i) to be combined.
    """
    ql = _unpack(blocks[:, :128].reshape(-1, 2, 64), 4, -2).unflatten(-1, (2, 32))
    qh = _unpack(blocks[:, 128:192].reshape(-1, 2, 32), 2, -2).unflatten(-2, (2, 2))
    q = ql.bitwise_or_(qh.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    _affine(out, q, _half(blocks, 208) * _reinterpret(blocks[:, 192:208], torch.int8))
