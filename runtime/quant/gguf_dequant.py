"""Dequantization of raw GGML blocks with plain torch ops.

GGUF weights are streamed to the compute device as their raw block bytes (a uint8 tensor, the
smallest thing to move) and expanded there, right before use. Every kernel is vectorized over
blocks, so it runs on CPU and CUDA alike, and is bit-exact with `gguf.quants.dequantize` for
float32 output: products are formed in float32 in the same order as the reference, with the
float16 scales widened to float32 first.
"""

from __future__ import annotations

import math
from typing import Callable

import gguf
import torch
from torch import Tensor

QType = gguf.GGMLQuantizationType

Kernel = Callable[[Tensor], Tensor]
DEQUANTIZERS: dict[QType, Kernel] = {}


class UnsupportedQuantType(ValueError):
    """A GGML type without a dequantizer here."""


def dequantizer(qtype: QType) -> Callable[[Kernel], Kernel]:
    """Register a kernel: (n_blocks, type_size) uint8 -> float32 with n_blocks * block_size elements."""

    def register(kernel: Kernel) -> Kernel:
        DEQUANTIZERS[qtype] = kernel
        return kernel

    return register


def dequantize(
    blocks: Tensor, qtype: QType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Tensor:
    """Expand raw GGML block bytes into a `dtype` tensor of `shape` (torch order, the reverse of GGUF's ne).

    Values are computed in float32 and then cast; F32 bytes read as float32 come back as a view of `blocks`.
    """
    kernel = DEQUANTIZERS.get(qtype)
    if kernel is None:
        supported = ", ".join(t.name for t in DEQUANTIZERS)
        raise UnsupportedQuantType(f"no dequantizer for GGML type {qtype.name}; supported: {supported}")
    if blocks.dtype != torch.uint8:
        raise TypeError(f"GGML blocks must be a uint8 tensor of raw bytes, got {blocks.dtype}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(shape)
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ValueError(
            f"{qtype.name} rows hold whole blocks of {block_size} values, but shape {shape} has rows of {row}"
        )
    n_blocks = math.prod(shape) // block_size
    if blocks.numel() != n_blocks * type_size:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, got {blocks.numel()}"
        )
    values = kernel(blocks.reshape(n_blocks, type_size))
    return values.reshape(shape).to(dtype)


def _half(raw: Tensor) -> Tensor:
    """Two bytes per block, a little-endian float16, widened to float32 of shape (n_blocks, 1)."""
    return raw.contiguous().view(torch.float16).float()


def _unpack(packed: Tensor, width: int, dim: int) -> Tensor:
    """Split each byte into its 8 // width fields of `width` bits, lowest first, along a new axis `dim`."""
    mask = (1 << width) - 1
    return torch.stack([(packed >> shift) & mask for shift in range(0, 8, width)], dim)


@dequantizer(QType.F32)
def _f32(blocks: Tensor) -> Tensor:
    return blocks.view(torch.float32)


@dequantizer(QType.F16)
def _f16(blocks: Tensor) -> Tensor:
    return blocks.view(torch.float16).float()


@dequantizer(QType.BF16)
def _bf16(blocks: Tensor) -> Tensor:
    return blocks.view(torch.bfloat16).float()


@dequantizer(QType.Q8_0)
def _q8_0(blocks: Tensor) -> Tensor:
    """34 bytes: d (f16), 32 int8 quants."""
    return blocks[:, 2:].view(torch.int8).float().mul_(_half(blocks[:, :2]))


@dequantizer(QType.Q4_0)
def _q4_0(blocks: Tensor) -> Tensor:
    """18 bytes: d (f16), 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31."""
    q = _unpack(blocks[:, 2:], 4, -2).reshape(-1, 32).view(torch.int8) - 8
    return q.float().mul_(_half(blocks[:, :2]))


@dequantizer(QType.Q4_1)
def _q4_1(blocks: Tensor) -> Tensor:
    """20 bytes: d (f16), m (f16), nibbles as in Q4_0; value = d * q + m."""
    q = _unpack(blocks[:, 4:], 4, -2).reshape(-1, 32)
    return q.float().mul_(_half(blocks[:, :2])).add_(_half(blocks[:, 2:4]))


def _q5(blocks: Tensor) -> Tensor:
    """The 5-bit quants of a Q5_0/Q5_1 block: qh (little-endian u32) holds bit 4 of value i at bit i."""
    qh = _unpack(blocks[:, :4], 1, -1).reshape(-1, 32)
    ql = _unpack(blocks[:, 4:], 4, -2).reshape(-1, 32)
    return ql | (qh << 4)


@dequantizer(QType.Q5_0)
def _q5_0(blocks: Tensor) -> Tensor:
    """22 bytes: d (f16), qh (4 bytes), 16 bytes of low nibbles."""
    return (_q5(blocks[:, 2:]).view(torch.int8) - 16).float().mul_(_half(blocks[:, :2]))


@dequantizer(QType.Q5_1)
def _q5_1(blocks: Tensor) -> Tensor:
    """24 bytes: d (f16), m (f16), qh (4 bytes), 16 bytes of low nibbles; value = d * q + m."""
    return _q5(blocks[:, 4:]).float().mul_(_half(blocks[:, :2])).add_(_half(blocks[:, 2:4]))


@dequantizer(QType.Q2_K)
def _q2_k(blocks: Tensor) -> Tensor:
    """84 bytes: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit quants, d, dmin.

    Each 32-byte half of the quants holds 128 values: 2-bit field j of byte i is value 32 * j + i.
    """
    scales = blocks[:, :16]
    d, dmin = _half(blocks[:, 80:82]), _half(blocks[:, 82:84])
    dl = (d * (scales & 0xF)).unsqueeze(-1)
    ml = (dmin * (scales >> 4)).unsqueeze(-1)
    q = _unpack(blocks[:, 16:80].reshape(-1, 2, 32), 2, -2).reshape(-1, 16, 16)
    return q.float().mul_(dl).sub_(ml)


@dequantizer(QType.Q3_K)
def _q3_k(blocks: Tensor) -> Tensor:
    """110 bytes: hmask (32), 2-bit quants (64, laid out as in Q2_K), 12 scale bytes, d (f16).

    Bit j of hmask byte i belongs to value 32 * j + i; a clear bit subtracts 4. The sixteen 6-bit
    scales keep their low 4 bits in the nibbles of bytes 0-7 (low nibbles first) and their top
    2 bits in the 2-bit fields of bytes 8-11 (field j of byte i is scale 4 * j + i).
    """
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = _unpack(scales[:, :8], 4, -2).reshape(-1, 16)
    high = _unpack(scales[:, 8:], 2, -2).reshape(-1, 16)
    dl = (_half(blocks[:, 108:110]) * ((low | (high << 4)).view(torch.int8) - 32)).unsqueeze(-1)
    ql = _unpack(qs.reshape(-1, 2, 32), 2, -2).reshape(-1, 16, 16).view(torch.int8)
    qh = _unpack(hmask, 1, -2).reshape(-1, 16, 16).view(torch.int8)
    return (ql - ((qh ^ 1) << 2)).float().mul_(dl)


def _scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Eight 6-bit scales and eight 6-bit mins from the 12 scale bytes of Q4_K/Q5_K.

    Bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top 2 bits of scales / mins
    4-7 in their high 2 bits; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and of
    mins 4-7 (high nibble).
    """
    sc, mn, mixed = scales[:, :4], scales[:, 4:8], scales[:, 8:]
    scale = torch.cat([sc & 0x3F, (mixed & 0xF) | ((sc >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([mn & 0x3F, (mixed >> 4) | ((mn >> 2) & 0x30)], dim=-1)
    return scale, minimum


def _k4_affine(blocks: Tensor, q: Tensor) -> Tensor:
    """d * scale * q - dmin * min over the eight 32-value sub-blocks of a Q4_K/Q5_K block."""
    scale, minimum = _scale_min_k4(blocks[:, 4:16])
    d = (_half(blocks[:, :2]) * scale).unsqueeze(-1)
    dm = (_half(blocks[:, 2:4]) * minimum).unsqueeze(-1)
    return q.float().mul_(d).sub_(dm)


@dequantizer(QType.Q4_K)
def _q4_k(blocks: Tensor) -> Tensor:
    """144 bytes: d, dmin (f16), 12 scale bytes, 128 bytes of nibbles.

    Each 32-byte chunk holds 64 values: low nibbles first, then high nibbles.
    """
    return _k4_affine(blocks, _unpack(blocks[:, 16:].reshape(-1, 4, 32), 4, -2).reshape(-1, 8, 32))


@dequantizer(QType.Q5_K)
def _q5_k(blocks: Tensor) -> Tensor:
    """176 bytes: d, dmin (f16), 12 scale bytes, qh (32), 128 bytes of nibbles laid out as in Q4_K.

    Bit j of qh byte i is bit 4 of value 32 * j + i.
    """
    ql = _unpack(blocks[:, 48:].reshape(-1, 4, 32), 4, -2).reshape(-1, 8, 32)
    qh = _unpack(blocks[:, 16:48], 1, -2)
    return _k4_affine(blocks, ql | (qh << 4))


@dequantizer(QType.Q6_K)
def _q6_k(blocks: Tensor) -> Tensor:
    """210 bytes: ql (128), qh (64), 16 int8 scales, d (f16).

    Per 128-value half: nibble j of ql byte i (64 bytes) is value 64 * j + i, and 2-bit field j of
    qh byte i (32 bytes) is the top 2 bits of value 32 * j + i.
    """
    ql = _unpack(blocks[:, :128].reshape(-1, 2, 64), 4, -2).reshape(-1, 8, 32)
    qh = _unpack(blocks[:, 128:192].reshape(-1, 2, 32), 2, -2).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(-1, 16, 16)
    d = (_half(blocks[:, 208:210]) * blocks[:, 192:208].view(torch.int8)).unsqueeze(-1)
    return q.float().mul_(d)
