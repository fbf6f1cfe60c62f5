"""The torch kernels: each GGML type's block layout, said once, over a design of the steps (`gguf_fields.Fields`:
the reference, any device; `gguf_cpu_fields.CpuFields`: the CPU's).

Every kernel is vectorized over blocks and bit-exact with `gguf.quants.dequantize` for float32 output: products are
formed in float32 in the same order as the reference, with the float16 scales widened to float32 first (NaN payloads
as the design keeps them). The IQ, E2M1 and UE4M3 types decode through lookup tables read from the gguf package
(`gguf_tables`).
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch
from torch import Tensor

from ..registry import Registry
from . import gguf_tables, huge_pages
from .gguf_fields import Fields, reinterpret, scale_groups, u16, words

QType = gguf.GGMLQuantizationType

Kernel = Callable[[Fields, Tensor, Tensor], None]
#: A kernel per GGML type: a design's steps, (n_blocks, type_size) uint8 blocks -> fills a (n_blocks, block_size)
#: float32 output. Filled from the one table at the end of this module; extensions register more.
DEQUANTIZERS: Registry[Kernel] = Registry("GGUF dequantizer")


def _q8_0(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """34 bytes: d (f16), 32 int8 quants."""
    f.affine(out, blocks[:, 2:].view(torch.int8), f.half(blocks, 0))


def _q4_0(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """18 bytes: d (f16), 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31."""
    f.affine(out, f.nibbles(blocks, 2).view(torch.int8).sub_(8), f.half(blocks, 0))


def _q4_1(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """20 bytes: d (f16), m (f16), nibbles as in Q4_0; value = d * q + m."""
    d = f.half(blocks, 0, 2)
    f.affine(out, f.nibbles(blocks, 4), d[:, :1], d[:, 1:])


def _q5_0(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """22 bytes: d (f16), qh (4 bytes), 16 bytes of low nibbles; value = d * (q - 16). qh (little-endian
    u32) holds bit 4 of value i at bit i."""
    f.affine(out, f.nibbles(blocks, 6, -16).view(torch.int8), f.half(blocks, 0))


def _q5_1(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """24 bytes: d (f16), m (f16), qh (4 bytes), 16 bytes of low nibbles; value = d * q + m."""
    d = f.half(blocks, 0, 2)
    f.affine(out, f.nibbles(blocks, 8, 0), d[:, :1], d[:, 1:])


def _q2_k(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """84 bytes: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit quants, d, dmin.

    Each 32-byte half of the quants holds 128 values: 2-bit field j of byte i is value 32 * j + i.
    """
    scales, d = f.rows(blocks, 0, 16), f.half(blocks, 80, 2)
    dl = d[:, :1] * f.factor(scales & 0xF)
    ml = f.minus(d[:, 1:], scales >> 4)
    f.affine(out, f.unpack(blocks[:, 16:80].reshape(-1, 2, 32), 2, -2), dl, ml)


def _q3_k(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """110 bytes: hmask (32), 2-bit quants (64, laid out as in Q2_K), 12 scale bytes, d (f16).

    Bit j of hmask byte i belongs to value 32 * j + i; a clear bit subtracts 4. The sixteen 6-bit
    scales keep their low 4 bits in the nibbles of bytes 0-7 (low nibbles first) and their top
    2 bits in the 2-bit fields of bytes 8-11 (field j of byte i is scale 4 * j + i).
    """
    f.affine(out, f.q3_k_quants(blocks), f.half(blocks, 108) * f.q3_k_scales(blocks[:, 96:108]))


def _scale_min_k4(blocks: Tensor) -> Tensor:
    """Eight 6-bit scales and eight 6-bit mins of each Q4_K/Q5_K block, as (n_blocks, 2, 8) uint8: scales, mins.

    Of the 12 scale bytes, bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top
    2 bits of scales / mins 4-7 in their high 2 bits; bytes 8-11 hold the low 4 bits of scales 4-7
    (low nibble) and of mins 4-7 (high nibble). Each group of four bytes is handled as one
    little-endian 32-bit word, four fields at a time, scales and mins side by side, so the work runs along blocks
    in as few ops as there are steps.
    """
    as_words = words(blocks, torch.int32)
    as_words = reinterpret(blocks[:, 4:16], torch.int32) if as_words is None else as_words[:, 1:4]
    first, mixed = as_words[:, :2], as_words[:, 2:]  # (scales 0-3, mins 0-3); low bits of 4-7
    upper = torch.cat([mixed & 0x0F0F0F0F, (mixed >> 4) & 0x0F0F0F0F], -1).bitwise_or_((first >> 2) & 0x30303030)
    return torch.stack([first & 0x3F3F3F3F, upper], -1).view(torch.uint8)


def _k4_affine(f: Fields, blocks: Tensor, q: Tensor, out: Tensor) -> None:
    """d * scale * q - dmin * min over the eight 32-value sub-blocks of a Q4_K/Q5_K block."""
    scales, mins = _scale_min_k4(blocks).unbind(1)
    d = f.half(blocks, 0, 2)
    f.affine(out, q, d[:, :1] * f.factor(scales), f.minus(d[:, 1:], mins))


def _q4_k(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """144 bytes: d, dmin (f16), 12 scale bytes, 128 bytes of nibbles.

    Each 32-byte chunk holds 64 values: low nibbles first, then high nibbles. Split four bytes a word where the
    blocks read as words.
    """
    as_words = words(blocks, torch.int32)
    if as_words is None:
        return _k4_affine(f, blocks, f.unpack(blocks[:, 16:].reshape(-1, 4, 32), 4, -2), out)
    n = blocks.shape[0]
    nibbles = huge_pages.empty((2, n, 4, 8), torch.int32, blocks.device)  # low then high, four bytes a word
    qs = as_words[:, 4:].view(n, 4, 8)
    torch.bitwise_and(qs, 0x0F0F0F0F, out=nibbles[0])
    torch.bitwise_right_shift(qs, 4, out=nibbles[1]).bitwise_and_(0x0F0F0F0F)
    _k4_affine(f, blocks, nibbles.view(torch.uint8).view(2, n, 4, 32).permute(1, 2, 0, 3), out)


def _q5_k(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """176 bytes: d, dmin (f16), 12 scale bytes, qh (32), 128 bytes of nibbles laid out as in Q4_K.

    Bit j of qh byte i is bit 4 of value 32 * j + i.
    """
    _k4_affine(f, blocks, f.q5_k_quants(blocks), out)


def _q6_k(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """210 bytes: ql (128), qh (64), 16 int8 scales, d (f16).

    Per 128-value half: nibble j of ql byte i (64 bytes) is value 64 * j + i, and 2-bit field j of
    qh byte i (32 bytes) is the top 2 bits of value 32 * j + i.
    """
    scales = f.factor(f.rows(blocks, 192, 208).view(torch.int8))
    f.affine(out, f.q6_k_quants(blocks), f.half(blocks, 208) * scales)


def _iq_scale(d: Tensor, scale: Tensor, step: float) -> Tensor:
    """The reference's `d * (0.5 + scale) * step`, in its order."""
    return d * (scale.float() + 0.5) * step


def _iq2_xxs(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """66 bytes: d (f16), then per 32 values two u32: four grid indices (bytes), and four 7-bit sign indices
    under a 4-bit scale; value = d * (0.5 + scale) / 4 * grid * signs."""
    aux = reinterpret(blocks[:, 2:], torch.int32)[:, 1::2]
    grid = blocks[:, 2:].reshape(-1, 8, 8)[..., :4].int()
    gguf_tables.lookup("iq2_xxs", f.bits(aux, 7, 4).mul_(256).add_(grid), out)
    scale_groups(out, _iq_scale(f.half(blocks, 0), (aux >> 28) & 15, 0.25))


def _iq2_xs(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """74 bytes: d (f16), 32 u16 (a 9-bit grid index under a 7-bit sign index, per 8 values), 8 bytes of
    4-bit scales (per 16 values). The table is laid out so that the u16 itself is the row."""
    gguf_tables.lookup("iq2_xs", u16(blocks, 2, 66), out)
    scale_groups(out, _iq_scale(f.half(blocks, 0), f.unpack(blocks[:, 66:], 4, -1).flatten(1), 0.25))


def _pair_index(index: Tensor) -> Tensor:
    """Int32 table indices (…, 2) viewed as one int64 per pair, so a term both share is added once, elementwise.

    `_PAIR * t` adds t to both halves; indices are far below 2^31, so nothing carries between them.
    """
    return index.view(torch.int64).squeeze(-1)


_PAIR = 1 + (1 << 32)


def _iq2_s(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """82 bytes: d (f16), 32 grid index low bytes, 32 sign bytes, 8 bytes of the indices' top 2 bits, 8 bytes
    of 4-bit scales (per 16 values). Grid rows are looked up in halves of 4, each with its 4 sign bits."""
    grid = blocks[:, 2:34].long().bitwise_or_(f.unpack(blocks[:, 66:74], 2, -1).flatten(1).long() << 8)
    index = f.unpack(blocks[:, 34:66], 4, -1).to(torch.int32, memory_format=torch.contiguous_format).mul_(2048)
    _pair_index(index).add_(grid.mul_(2 * _PAIR).add_(1 << 32))  # pattern (a sign nibble) * 2048 + 2 * grid + half
    gguf_tables.lookup("iq2_s", index, out)
    scale_groups(out, _iq_scale(f.half(blocks, 0), f.unpack(blocks[:, 74:], 4, -1).flatten(1), 0.25))


def _iq3_xxs(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """98 bytes: d (f16), 64 grid indices (4 values each), 8 u32 of four 7-bit sign indices (per 8 values)
    under a 4-bit scale (per 32); value = d * (0.5 + scale) / 2 * grid * signs.

    The table's pattern 2 * s + h holds half h of sign index s, for the h-th grid row of its 8 values.
    """
    aux = reinterpret(blocks[:, 66:], torch.int32)
    index = blocks[:, 2:66].int().view(-1, 8, 4, 2)
    _pair_index(index).add_(f.bits(aux, 7, 4).long().mul_(512 * _PAIR).add_(256 << 32))
    gguf_tables.lookup("iq3_xxs", index, out)
    scale_groups(out, _iq_scale(f.half(blocks, 0), (aux >> 28) & 15, 0.5))


def _iq3_s(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """110 bytes: d (f16), 64 grid index low bytes (4 values each), 8 bytes of their 9th bits, 32 sign bytes
    (per 8 values), 4 bytes of 4-bit scales (per 32); value = d * (1 + 2 * scale) * grid * signs."""
    index = f.unpack(blocks[:, 74:106], 4, -1).flatten(1).int().mul_(512)
    index.add_(blocks[:, 2:66].int()).add_(f.unpack(blocks[:, 66:74], 1, -1).flatten(1).int() << 8)
    gguf_tables.lookup("iq3_s", index, out)
    scale_groups(out, f.half(blocks, 0) * (f.unpack(blocks[:, 106:], 4, -1).flatten(1) * 2 + 1))


def _iq1_s(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """50 bytes: d (f16), 32 grid index low bytes (8 values each), 8 u16 (per 32 values): four 3-bit index
    tops, a 3-bit scale and delta's sign; value = d * (2 * scale + 1) * (grid +- 1/8)."""
    qh = u16(blocks, 34, 50)
    top = f.bits(qh, 3, 4).bitwise_or_(((qh >> 15) << 3).unsqueeze(-1))
    gguf_tables.lookup("iq1", top.mul_(256).add_(blocks[:, 2:34].reshape(-1, 8, 4)), out)
    scale_groups(out, f.half(blocks, 0) * (((qh >> 12) & 7) * 2 + 1))


def _iq1_m(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """56 bytes: 32 grid index low bytes (8 values each), 16 bytes of nibbles (3 index top bits and delta's
    sign, per 8 values), 4 u16 of four 3-bit scales (per 16 values) with d's f16 bits in their top nibbles."""
    gguf_tables.lookup("iq1", f.unpack(blocks[:, 32:48], 4, -1).flatten(1).int().mul_(256).add_(blocks[:, :32]), out)
    scales = u16(blocks, 48, 56)
    d = torch.zeros_like(scales[:, :1])
    for index in range(4):
        d |= (scales[:, index : index + 1] >> 12) << (4 * index)
    d = f.widen_half((d - ((d >> 15) << 16)).short())  # wrapped into int16's range first
    scale_groups(out, d * (f.bits(scales, 3, 4).flatten(1) * 2 + 1))


def _iq4_nl(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """18 bytes: d (f16), 16 bytes whose low nibbles index values 0-15 and high nibbles 16-31 in a 16-value table."""
    f.scaled_nibbles(blocks[:, 2:], "iq4_nl", f.half(blocks, 0), out)


def _iq4_xs(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """136 bytes: d (f16), a u16 of 2-bit scale tops, 4 bytes of 4-bit scale bottoms (per 32 values), then
    128 bytes laid out as eight IQ4_NL blocks without d; value = d * (scale - 32) * table value."""
    low = f.unpack(blocks[:, 4:8], 4, -1).flatten(1)
    high = f.unpack(blocks[:, 2:4], 2, -1).flatten(1)  # the u16's 2-bit fields, little-endian: bytes in order
    scale = (low | (high << 4)).view(torch.int8).sub_(32)
    f.scaled_nibbles(blocks[:, 8:].unflatten(1, (8, 16)), "iq4_nl", f.half(blocks, 0) * f.factor(scale), out)


def _mxfp4(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """17 bytes: an E8M0 exponent e, 16 bytes of E2M1 nibbles (doubled, as ggml keeps them), low then high;
    value = 2^(e - 128) * kvalue."""
    scale = gguf_tables.table("e8m0", blocks.device).index_select(0, blocks[:, 0].int())
    f.scaled_nibbles(blocks[:, 1:], "mxfp4", scale.unsqueeze(-1), out)


def _nvfp4(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """36 bytes: four UE4M3 scales (per 16 values), then per 16 values 8 bytes of E2M1 nibbles, low then high."""
    scale = gguf_tables.table("ue4m3", blocks.device).index_select(0, blocks[:, :4].reshape(-1).int())
    f.scaled_nibbles(blocks[:, 4:].unflatten(1, (4, 8)), "nvfp4", scale.view(-1, 4), out)


def _tq1_0(f: Fields, blocks: Tensor, out: Tensor) -> None:
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
    f.affine(out, digit.bitwise_right_shift_(6).sub_(1).view(torch.int8), f.half(blocks, 52))


def _tq2_0(f: Fields, blocks: Tensor, out: Tensor) -> None:
    """66 bytes: 64 bytes of 2-bit fields laid out as Q2_K's quants, d (f16) at 64; value = d * (field - 1)."""
    f.affine(out, f.unpack(blocks[:, :64].reshape(-1, 2, 32), 2, -2).view(torch.int8).sub_(1), f.half(blocks, 64))


#: Every GGML type dequantized here (the stored floats, F32/F16/BF16, are `gguf_dequant.STORED_FLOATS`).
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
