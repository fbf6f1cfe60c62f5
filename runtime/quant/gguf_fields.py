"""How torch ops take GGML blocks' fields apart: the reference design, one that runs on any device.

The torch kernels (`gguf_torch_kernels`) say each type's layout once, in terms of a `Fields`; this one takes each
step in as few ops as it can, whatever their width, since on a GPU an op costs its launch: a field of every byte in
one broadcast shift against a table of shifts and one mask, products that convert their integer operand as they read
it. Its float32 results are gguf's reference values bit for bit, NaNs by place (the half scales are widened by
torch's conversion, which keeps no NaN payload, as a GPU's arithmetic keeps none). The CPU's design
(`gguf_cpu_fields`) takes the same steps the way a CPU's ops run them fast.

Below the class, the steps both designs share: reading bytes as wider words, scaling groups of values, the
lookup tables' gathers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import gguf_tables


class Fields:
    """The reference design: each step in as few ops as it can, on any device."""

    def half(self, blocks: Tensor, offset: int, count: int = 1) -> Tensor:
        """The `count` little-endian float16 from byte `offset` of every block (d, or d and dmin), widened to float32
        of shape (n_blocks, count)."""
        as_words = words(blocks, torch.int16) if offset % 2 == 0 else None
        if as_words is None:
            return self.widen_half(reinterpret(blocks[:, offset : offset + 2 * count], torch.int16))
        return self.widen_half(as_words[:, offset // 2 : offset // 2 + count])

    def widen_half(self, bits: Tensor) -> Tensor:
        """float16 bits (int16, any layout) as float32, by torch's conversion: one op."""
        return bits.view(torch.float16).float()

    def unpack(self, packed: Tensor, width: int, dim: int) -> Tensor:
        """Split each byte into its 8 // width fields of `width` bits, lowest first, along a new axis `dim`: every
        field shifted out by one broadcast op against a table of shifts, masked by a second."""
        return broadcast_fields(packed, width, 8 // width).movedim(-1, dim)

    def bits(self, word: Tensor, width: int, count: int) -> Tensor:
        """The `count` fields of `width` bits of each (int32) `word`, lowest first, along a new last axis."""
        return broadcast_fields(word, width, count)

    def affine(self, out: Tensor, q: Tensor, scale: Tensor, offset: Tensor | None = None) -> None:
        """Fill `out` with float32(q) * scale (+ offset), in q's element order: the product converts q as it reads
        it, in whatever layout its fields were built in, one pass over the float output."""
        q, scale = _grouped(q, scale)
        values = out.view(q.shape)
        if torch.compiler.is_compiling():  # a graph writes no `out=` of another layout than its result's; fused there
            values.copy_(q * scale if offset is None else offset.view(scale.shape) + q * scale)
            return
        torch.mul(q, scale, out=values)
        if offset is not None:
            torch.add(offset.view(scale.shape), values, out=values)

    def factor(self, ints: Tensor) -> Tensor:
        """Small integers ready to multiply a float scale: as they are, the product converts them."""
        return ints

    def minus(self, dmin: Tensor, m: Tensor) -> Tensor:
        """The reference's `- dmin * m` (m small unsigned integers) as a term to add, which adds as it subtracts:
        IEEE negation is exact, and a zero m gives the -0 the subtraction's +0 needs. The few dmin are negated, and
        the product converts m as it reads it."""
        return dmin.neg() * m

    def rows(self, blocks: Tensor, start: int, stop: int) -> Tensor:
        """Bytes `start:stop` of every block, a view: an op reads any layout at its cost."""
        return blocks[:, start:stop]

    def nibbles(self, blocks: Tensor, start: int, high_offset: int | None = None) -> Tensor:
        """The 16 bytes at `start` of every block split into 32 nibbles, (n_blocks, 32) bytes: low nibbles are
        values 0-15, high ones 16-31; with `high_offset` (Q5_0/Q5_1), plus 16 times bit i of the little-endian u32
        in the preceding 4 bytes for value i, plus the offset (mod 256). Three ops along the bytes, the top bits as
        broadcast fields."""
        qs = blocks[:, start : start + 16]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
        if high_offset is None:
            return q
        return torch.add(q, self.unpack(blocks[:, start - 4 : start], 1, -1).flatten(1), alpha=16).add_(high_offset)

    def q3_k_quants(self, blocks: Tensor) -> Tensor:
        """Q3_K's signed quants in value order, (n_blocks, 128-value half, field, byte): bit j of hmask byte i
        belongs to value 32 * j + i, and a clear bit subtracts 4."""
        hmask = self.unpack(blocks[:, :32], 1, -2).unflatten(1, (2, 4))
        low = self.unpack(blocks[:, 32:96].unflatten(1, (2, 32)), 2, -2)
        return torch.add(low, hmask, alpha=4).view(torch.int8).sub_(4)

    def q3_k_scales(self, packed: Tensor) -> Tensor:
        """Q3_K's sixteen signed 6-bit scales from its 12 scale bytes, (n_blocks, 16) `factor`s: low 4 bits in the
        nibbles of bytes 0-7 (scale 8 * nibble + byte), top 2 bits in the fields of bytes 8-11 (4 * field + byte)."""
        low = self.unpack(packed[:, :8], 4, -2).unflatten(-1, (2, 4))
        high = self.unpack(packed[:, 8:], 2, -2).unflatten(1, (2, 2))
        return (low | (high << 4)).view(torch.int8).sub_(32).flatten(1)

    def q5_k_quants(self, blocks: Tensor) -> Tensor:
        """Q5_K's quants, (n_blocks, 32-byte chunk, nibble, byte): value 64c + 32nib + i is the nibble of ql plus 16
        times bit 2c + nib of qh byte i."""
        ql = self.unpack(blocks[:, 48:].reshape(-1, 4, 32), 4, -2)
        return torch.add(ql, self.unpack(blocks[:, 16:48], 1, -2).unflatten(1, (4, 2)), alpha=16)

    def q6_k_quants(self, blocks: Tensor) -> Tensor:
        """Q6_K's signed quants in value order, (n_blocks, half, nibble of ql, 32-value run, byte): field j of qh is
        nibble j // 2, run j % 2."""
        low = self.unpack(blocks[:, :128].unflatten(1, (2, 64)), 4, -2).unflatten(-1, (2, 32))
        high = self.unpack(blocks[:, 128:192].unflatten(1, (2, 32)), 2, -2).unflatten(2, (2, 2))
        return (low | (high << 4)).view(torch.int8).sub_(32)

    def scaled_nibbles(self, qs: Tensor, name: str, scale: Tensor, out: Tensor) -> None:
        """Fill `out` (n_blocks, values) with table `name`'s values of the nibbles of qs (n_blocks, ..., k bytes)
        times `scale` (n_blocks, groups): of each k bytes, low nibbles are values 0..k-1, high ones k..2k-1. Each byte
        picks its low and high nibbles' values, and the product reads them in value order."""
        pairs = gguf_tables.table(name, qs.device).view(torch.float32).view(-1, 2)
        values = pairs.index_select(0, qs.int().view(-1))
        self.affine(out, values.view(*qs.shape, 2).transpose(-1, -2), scale)


def reinterpret(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """Bytes read as `dtype` along the last axis: a view where their layout and offset allow one, else a copy's.

    A compiled graph cannot read a storage offset; the blocks it dequantizes are residents', whose
    storage is aligned when they are made, so there only the layout is fixed.
    """
    if torch.compiler.is_compiling():
        return raw.contiguous().view(dtype)
    if not raw.is_contiguous() or raw.storage_offset() % dtype.itemsize:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(dtype)


def words(blocks: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The blocks read as `dtype` words, a view (no copy), or None where their size or layout does not allow one.

    Kernels read their fields as strided slices of it: a narrow slice of the bytes would be copied first.
    """
    if blocks.shape[-1] % dtype.itemsize:
        return None
    if torch.compiler.is_compiling() or (blocks.is_contiguous() and blocks.storage_offset() % dtype.itemsize == 0):
        return reinterpret(blocks, dtype)
    return None


def broadcast_fields(packed: Tensor, width: int, count: int) -> Tensor:
    """The `count` fields of `width` bits of each integer of `packed`, lowest first, along a new last axis, in two
    ops whatever the count: one shift against the shifts, one mask. The shifts come from a table made once per
    device, or, in a compiled graph, which reads no device's table without a break, are made there (a constant to
    the compiler)."""
    if torch.compiler.is_compiling():
        shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=packed.device)
    else:
        shifts = gguf_tables.table(f"shifts{width}", packed.device)[:count]
    return (packed.unsqueeze(-1) >> shifts).bitwise_and_((1 << width) - 1)


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


def scale_groups(out: Tensor, scale: Tensor, offset: Tensor | None = None) -> None:
    """Multiply each group of consecutive values of `out` by its term of `scale` (n_blocks, groups), in place,
    then add `offset` (same shape).

    The reference's `d * q + m` returns d * q's NaN when both are NaN (x86 keeps the first operand's);
    torch's add keeps the second's, so the sum is formed as `m + d * q`.
    """
    groups = out.view(*scale.shape, -1).mul_(scale.unsqueeze(-1))
    if offset is not None:
        torch.add(offset.unsqueeze(-1), groups, out=groups)


def u16(blocks: Tensor, start: int, stop: int) -> Tensor:
    """The little-endian uint16 words of bytes `start:stop` of every block, as int32."""
    return reinterpret(blocks[:, start:stop], torch.int16).int().bitwise_and_(0xFFFF)
