"""The CPU's design of the torch kernels' steps (`gguf_fields.Fields`): what runs where numba's fused kernels do not
(numba not installed, the types it lacks, a compiled graph or another tracer).

The expansion is memory-bound, so on a CPU each step writes whole contiguous planes, the integer quants once into the
float32 output, scaled there in place, and decodes the few scale bytes of each block without narrow strided slices,
which torch runs slowly: fields are cut from int16/int32/int64 words of several bytes at once, one column of words
per op, through tables where bit ops would take several. Few ops matter too: torch splits an op on a few hundred
thousand scales across its threads, and each split is a hand-off between them, which costs a scheduler slice
(milliseconds) while another process holds a core and libgomp's waiting threads spin. Large buffers are on huge pages
where the platform has them (`huge_pages`). Mixed-type products are avoided: a CPU elementwise op casts mixed inputs
through a temporary copy, where a GPU kernel converts each value as it loads it. On 4096x4096 blocks of the common
types this design is 1.5-5.7x faster on a CPU than the reference's (`docs/quantized-weights.md`).

Its float32 results have the reference's bits and, beyond them, gguf's NaN payloads: the half scales are widened as
numpy widens them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import gguf_tables, huge_pages
from .gguf_fields import Fields, reinterpret, scale_groups, words

_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F


class CpuFields(Fields):
    """The steps as a CPU runs them fast, NaN payloads kept."""

    def widen_half(self, bits: Tensor) -> Tensor:
        """As numpy widens (NaNs keep sign and payload, signalling ones too): a gather from numpy's own widening of
        every half (a 256 KB table). torch's conversion returns one canonical NaN in its scalar path and quiets
        signalling NaNs in its vector path, and the gather takes two ops where rebuilding NaNs from the bits takes
        seven."""
        index = bits.view(torch.uint16).int()  # zero-extended, and gathered from strided columns in the same op
        return gguf_tables.CPU_TABLES["f16"].index_select(0, index.view(-1)).view(bits.shape)

    def unpack(self, packed: Tensor, width: int, dim: int) -> Tensor:
        """Each field computed whole and contiguous, the new axis moved into place as a view, so the interleaving
        happens once, in the copy into the float output."""
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

    def affine(self, out: Tensor, q: Tensor, scale: Tensor, offset: Tensor | None = None) -> None:
        """The integers copied into the output, then scaled there."""
        out.view(q.shape).copy_(q)
        scale_groups(out, scale, offset)

    def factor(self, ints: Tensor) -> Tensor:
        """As float32: a product of mixed types copies its integer operand first (slowly)."""
        return ints.float()

    def minus(self, dmin: Tensor, m: Tensor) -> Tensor:
        """m negated, so a NaN dmin passes through the product unchanged, sign included."""
        return dmin * m.float().neg_()

    def rows(self, blocks: Tensor, start: int, stop: int) -> Tensor:
        """Copied whole: ops run slowly on narrow strided slices."""
        return blocks[:, start:stop].contiguous()

    def nibbles(self, blocks: Tensor, start: int, high_offset: int | None = None) -> Tensor:
        """Built eight values at a time in int64 words, one column of words (n_blocks long) per op: a block's fields
        are too narrow for ops along them; each byte of the u32 becomes its eight values' top bits, offset included,
        through a table (a byte -> eight bytes, as int64)."""
        n, device = blocks.shape[0], blocks.device
        as_words = words(blocks, torch.int64) if start % 8 == 0 else None
        qs = reinterpret(blocks[:, start : start + 16], torch.int64) if as_words is None else as_words[:, start // 8 :]
        q = huge_pages.empty((n, 4), torch.int64, device)
        if high_offset is None:
            for word in range(2):
                torch.bitwise_and(qs[:, word], _LOW_NIBBLES, out=q[:, word])
                torch.bitwise_right_shift(qs[:, word], 4, out=q[:, 2 + word]).bitwise_and_(_LOW_NIBBLES)
            return q.view(torch.uint8).view(n, 32)
        index = torch.empty((n, 4), dtype=torch.int32, device=device)
        for byte in range(4):
            index[:, byte].copy_(blocks[:, start - 4 + byte])
        torch.index_select(gguf_tables.table(f"q5_high{high_offset}", device), 0, index.view(-1), out=q.view(-1))
        for word in range(2):
            q[:, word].bitwise_or_(qs[:, word] & _LOW_NIBBLES)
            q[:, 2 + word].bitwise_or_((qs[:, word] >> 4).bitwise_and_(_LOW_NIBBLES))
        return q.view(torch.uint8).view(n, 32)

    def q3_k_quants(self, blocks: Tensor) -> Tensor:
        """Built two bytes at a time in int16 words (every field stays inside its byte) as four planes, one per
        2-bit field of the quant bytes, laid out as those are; the copy into the float output interleaves them."""
        n, device = blocks.shape[0], blocks.device
        as_words = words(blocks, torch.int16)
        if as_words is None:
            as_words = reinterpret(blocks.contiguous(), torch.int16)
        planes = huge_pages.empty((4, n, 2, 16), torch.int16, device)  # field, block, 128-value half, word
        qs = as_words[:, 16:48].view(n, 2, 16)
        planes[0].copy_(qs)
        for field in range(1, 4):
            torch.bitwise_right_shift(qs, 2 * field, out=planes[field])
        planes.bitwise_and_(0x0303)
        hmask = as_words[:, :16].contiguous().view(n, 1, 16)  # whole rows: cat interleaves contiguous inputs fastest
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

    def q3_k_scales(self, packed: Tensor) -> Tensor:
        """Four fields at a time in int32 words."""
        low, high = reinterpret(packed.contiguous(), torch.int32).split([2, 1], -1)
        low = torch.cat([low, low >> 4], -1).bitwise_and_(0x0F0F0F0F)  # scales 0-3, 4-7, 8-11, 12-15
        high = torch.cat([high >> 2 * field for field in range(4)], -1)  # field j of 4 bytes at once
        low.bitwise_or_(high.bitwise_and_(0x03030303).bitwise_left_shift_(4))
        return low.view(torch.uint8).float().sub_(32)

    def q5_k_quants(self, blocks: Tensor) -> Tensor:
        """Each bit j of qh moved to bit 4 of its byte for eight bytes at a time (an int64 word, one op per bit over
        the few words), so the top bits come out as the nibbles are laid out, runs of 32 values."""
        n = blocks.shape[0]
        ql = self.unpack(blocks[:, 48:].reshape(-1, 4, 32), 4, -2)  # (block, chunk, nibble, byte)
        as_words = words(blocks, torch.int64)
        qh = reinterpret(blocks[:, 16:48], torch.int64) if as_words is None else as_words[:, 2:6].contiguous()
        high = huge_pages.empty((8, n, 4), torch.int64, blocks.device)  # bit, block, word
        for bit, plane in enumerate(high):
            if bit < 4:
                torch.bitwise_left_shift(qh, 4 - bit, out=plane)
            else:
                torch.bitwise_right_shift(qh, bit - 4, out=plane)
        high.bitwise_and_(0x1010101010101010)
        ql.movedim(-2, 0).bitwise_or_(high.view(torch.uint8).view(4, 2, n, 32).permute(1, 2, 0, 3))  # in ql's storage
        return ql

    def q6_k_quants(self, blocks: Tensor) -> Tensor:
        """Built two bytes at a time in int16 words (every field stays inside its byte) as two planes, one per
        nibble of ql, each laid out as ql is; the copy into the float output interleaves them."""
        n, device = blocks.shape[0], blocks.device
        as_words = words(blocks, torch.int16)
        if as_words is None:
            as_words = reinterpret(blocks.contiguous(), torch.int16)
        ql, qh = as_words[:, :64].view(n, 2, 2, 16), as_words[:, 64:96].view(n, 2, 1, 16)
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

    def scaled_nibbles(self, qs: Tensor, name: str, scale: Tensor, out: Tensor) -> None:
        """Each lookup writes two adjacent float32 values as one int64, indexed by a pair of bytes read as one word
        (their low nibbles' values, or, offset, their high nibbles'), so the gather lands in value order, a quarter as
        many indices are needed and no bit op splits a byte; the scale multiplies in place."""
        pairs = reinterpret(qs.reshape(-1, qs.shape[-1]), torch.uint16)
        if torch.compiler.is_compiling():  # a graph takes no strided `out=`; fused there
            low = pairs.int()
            index = torch.cat([low, low + (1 << 16)], 1)
        else:
            index = torch.empty((pairs.shape[0], 2, pairs.shape[1]), dtype=torch.int32, device=qs.device)
            index[:, 0] = pairs  # zero-extended
            torch.add(index[:, 0], 1 << 16, out=index[:, 1])  # the high nibbles' half of the table
        torch.index_select(gguf_tables.table(f"{name}_words", qs.device), 0, index.view(-1),
                           out=out.view(torch.int64).view(-1))
        scale_groups(out, scale)
