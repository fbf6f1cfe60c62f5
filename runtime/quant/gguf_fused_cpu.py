"""Fused CPU kernels for the common GGML types, compiled by numba: one pass from blocks to float32 values.

The torch kernels (`gguf_torch_kernels`) are made of whole-tensor ops, so on the CPU each one writes its quants into the
float output and then passes over it again to scale it (and again to add the offset): two or three passes over a
buffer eight times the size of its blocks, where writing it once is most of the cost. These kernels decode each block
where it lies and write each value once. numba (an optional dependency: `pip install streamwise[cpu-kernels]`)
compiles them to machine code when this module is first imported (about 6 s, cached on disk: later processes load
them in under half a second), so no C compiler is needed; without it `gguf_dequant` keeps the torch kernels.

Every kernel computes what `gguf.quants` computes, in float32 and in the same order, so the output is bit-exact with
it, NaN payloads included: scales are widened through numpy's own table of every half (`half`, passed in); where the
reference adds two terms that may both be NaN (`d * q + m`), its first operand's NaN is kept explicitly, since the
compiler may swap the operands of a sum (not those of a difference, `d * q - m`). Inner loops take their length from
the output's shape (`run`), not a literal: LLVM unrolls a loop of a known short length whole and then leaves it
scalar (Q8_0 ran at 13.8 ms, 8.1 ms with the length read at run time).

One compiled task runs them all (`_task`): threads claim ranges of blocks from a shared counter until none is left,
so it is right on however many threads call it; `torch_openmp` runs it on torch's own OpenMP workers.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import torch_openmp
from .errors import QuantError

QType = gguf.GGMLQuantizationType

#: IQ4_NL's and IQ4_XS's 16 values (int8), a constant to the compiled code.
_IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int8)
#: Below this many blocks per thread, another thread is not worth its hand-off; a claimed range is a quarter of it
#: or more.
_BLOCKS_PER_THREAD = 1024


def _compiled_task(task: Callable):
    """`task` compiled as a C function `void task(void *data)`, its machine code cached beside this module or in the
    user's cache (numba refuses `cache=True` where neither can be written: then each process compiles it)."""
    try:
        return numba.cfunc(types.void(types.voidptr), cache=True)(task)
    except RuntimeError:
        return numba.cfunc(types.void(types.voidptr))(task)


@numba.njit(inline="always")
def _half(blocks, b, offset, half):
    """The little-endian float16 at byte `offset` of block `b`, widened as numpy widens it."""
    return half[np.int32(blocks[b, offset]) | (np.int32(blocks[b, offset + 1]) << 8)]


@numba.njit(inline="always")
def _plus(p, m):
    """The reference's `p + m`: p's NaN where p is one (the first operand's), whatever order the sum is formed in."""
    return p if p != p else p + m


@numba.njit(inline="always")
def _k4_scale_min(blocks, b, j):
    """Scale and min `j` (0-7) of a Q4_K/Q5_K block, from its 12 scale bytes at byte 4 (gguf's `get_scale_min`)."""
    if j < 4:
        return blocks[b, 4 + j] & 63, blocks[b, 8 + j] & 63
    low = blocks[b, 12 + j - 4]
    return (low & 15) | ((blocks[b, j] >> 2) & 0x30), (low >> 4) | ((blocks[b, 4 + j] >> 2) & 0x30)


@numba.njit
def _q8_0(blocks, out, half):
    run = out.shape[1]  # 32
    for b in range(blocks.shape[0]):
        d = _half(blocks, b, 0, half)
        for i in range(run):
            out[b, i] = np.float32(np.int8(blocks[b, 2 + i])) * d


@numba.njit
def _q4_0(blocks, out, half):
    run = out.shape[1] // 2  # 16
    for b in range(blocks.shape[0]):
        d = _half(blocks, b, 0, half)
        for i in range(run):
            byte = np.int32(blocks[b, 2 + i])
            out[b, i] = d * np.float32((byte & 15) - 8)
            out[b, 16 + i] = d * np.float32((byte >> 4) - 8)


@numba.njit
def _q4_1(blocks, out, half):
    run = out.shape[1] // 2  # 16
    for b in range(blocks.shape[0]):
        d, m = _half(blocks, b, 0, half), _half(blocks, b, 2, half)
        for i in range(run):
            byte = np.int32(blocks[b, 4 + i])
            out[b, i] = _plus(d * np.float32(byte & 15), m)
            out[b, 16 + i] = _plus(d * np.float32(byte >> 4), m)


@numba.njit(inline="always")
def _q5_bits(blocks, b, start):
    """The little-endian u32 at byte `start` of block `b`: bit i is bit 4 of value i."""
    qh = np.uint32(0)
    for k in range(4):
        qh |= np.uint32(blocks[b, start + k]) << np.uint32(8 * k)
    return qh


@numba.njit
def _q5_0(blocks, out, half):
    run = out.shape[1] // 2  # 16
    for b in range(blocks.shape[0]):
        d, qh = _half(blocks, b, 0, half), _q5_bits(blocks, b, 2)
        for i in range(run):
            byte = np.int32(blocks[b, 6 + i])
            low = (byte & 15) | np.int32(((qh >> np.uint32(i)) & np.uint32(1)) << np.uint32(4))
            high = (byte >> 4) | np.int32(((qh >> np.uint32(16 + i)) & np.uint32(1)) << np.uint32(4))
            out[b, i] = d * np.float32(low - 16)
            out[b, 16 + i] = d * np.float32(high - 16)


@numba.njit
def _q5_1(blocks, out, half):
    run = out.shape[1] // 2  # 16
    for b in range(blocks.shape[0]):
        d, m, qh = _half(blocks, b, 0, half), _half(blocks, b, 2, half), _q5_bits(blocks, b, 4)
        for i in range(run):
            byte = np.int32(blocks[b, 8 + i])
            low = (byte & 15) | np.int32(((qh >> np.uint32(i)) & np.uint32(1)) << np.uint32(4))
            high = (byte >> 4) | np.int32(((qh >> np.uint32(16 + i)) & np.uint32(1)) << np.uint32(4))
            out[b, i] = _plus(d * np.float32(low), m)
            out[b, 16 + i] = _plus(d * np.float32(high), m)


@numba.njit
def _q2_k(blocks, out, half):
    """Sub-block k = 8h + 2j + s (values 16k..16k + 15) is 2-bit field j of quant bytes 32h + 16s + i."""
    run = out.shape[1] // 16  # 16
    for b in range(blocks.shape[0]):
        d, dmin = _half(blocks, b, 80, half), _half(blocks, b, 82, half)
        for k in range(16):
            scale, start, shift = blocks[b, k], 16 + 32 * (k >> 3) + 16 * (k & 1), 2 * ((k >> 1) & 3)
            dl, ml = d * np.float32(scale & 15), dmin * np.float32(scale >> 4)
            for i in range(run):
                q = (blocks[b, start + i] >> shift) & 3
                out[b, 16 * k + i] = dl * np.float32(q) - ml


@numba.njit
def _q3_k(blocks, out, half):
    """Sub-block k = 8h + 2j + s as in Q2_K (quant bytes from 32), less 4 where bit 4h + j of hmask byte 16s + i
    is clear; its 6-bit signed scale is low nibble k & 7 of bytes 96-103 and 2-bit field k of bytes 104-107."""
    run = out.shape[1] // 16  # 16
    for b in range(blocks.shape[0]):
        d = _half(blocks, b, 108, half)
        for k in range(16):
            low = (blocks[b, 96 + (k & 7)] >> (4 * (k >> 3))) & 15
            top = (blocks[b, 104 + (k & 3)] >> (2 * (k >> 2))) & 3
            dl = d * np.float32(np.int32(low | (top << 4)) - 32)
            mask, start, shift = 16 * (k & 1), 32 + 32 * (k >> 3) + 16 * (k & 1), 2 * ((k >> 1) & 3)
            bit = 4 * (k >> 3) + ((k >> 1) & 3)
            for i in range(run):
                q = np.int32((blocks[b, start + i] >> shift) & 3)
                q -= np.int32((((blocks[b, mask + i] >> bit) & 1) ^ 1) << 2)
                out[b, 16 * k + i] = dl * np.float32(q)


@numba.njit
def _q4_k(blocks, out, half):
    """Value 64c + 32n + i is nibble n of quant byte 32c + i, in sub-block 2c + n."""
    run = out.shape[1] // 8  # 32
    for b in range(blocks.shape[0]):
        d, dmin = _half(blocks, b, 0, half), _half(blocks, b, 2, half)
        for j in range(8):
            scale, low = _k4_scale_min(blocks, b, j)
            dl, ml = d * np.float32(scale), dmin * np.float32(low)
            shift, start = 4 * (j & 1), 16 + 32 * (j >> 1)
            for i in range(run):
                q = (blocks[b, start + i] >> shift) & 15
                out[b, 32 * j + i] = dl * np.float32(q) - ml


@numba.njit
def _q5_k(blocks, out, half):
    """As Q4_K, with bit j of qh byte i (at byte 16) as bit 4 of value 32j + i."""
    run = out.shape[1] // 8  # 32
    for b in range(blocks.shape[0]):
        d, dmin = _half(blocks, b, 0, half), _half(blocks, b, 2, half)
        for j in range(8):
            scale, low = _k4_scale_min(blocks, b, j)
            dl, ml = d * np.float32(scale), dmin * np.float32(low)
            shift, start = 4 * (j & 1), 48 + 32 * (j >> 1)
            for i in range(run):
                q = ((blocks[b, start + i] >> shift) & 15) | (((blocks[b, 16 + i] >> j) & 1) << 4)
                out[b, 32 * j + i] = dl * np.float32(q) - ml


@numba.njit
def _q6_k(blocks, out, half):
    """Sub-block k = 8h + 2j + s (values 16k..16k + 15): nibble j >> 1 of ql bytes 64h + 32(j & 1) + 16s + i, topped
    by 2-bit field j of qh bytes 32h + 16s + i; each sub-block has an int8 scale."""
    run = out.shape[1] // 16  # 16
    for b in range(blocks.shape[0]):
        d = _half(blocks, b, 208, half)
        for k in range(16):
            h, j, s = k >> 3, (k >> 1) & 3, k & 1
            dl = d * np.float32(np.int8(blocks[b, 192 + k]))
            low_start, top_start = 64 * h + 32 * (j & 1) + 16 * s, 128 + 32 * h + 16 * s
            for i in range(run):
                low = (blocks[b, low_start + i] >> (4 * (j >> 1))) & 15
                top = (blocks[b, top_start + i] >> (2 * j)) & 3
                out[b, 16 * k + i] = dl * np.float32(np.int32(low | (top << 4)) - 32)


@numba.njit
def _iq4_nl(blocks, out, half):
    run = out.shape[1] // 2  # 16
    for b in range(blocks.shape[0]):
        d = _half(blocks, b, 0, half)
        for i in range(run):
            byte = blocks[b, 2 + i]
            out[b, i] = d * np.float32(_IQ4_VALUES[byte & 15])
            out[b, run + i] = d * np.float32(_IQ4_VALUES[byte >> 4])


@numba.njit
def _iq4_xs(blocks, out, half):
    """Sub-block k (32 values): a 6-bit scale (low nibble k of bytes 4-7, 2-bit field k of the u16 at byte 2), then
    IQ4_NL's layout over quant bytes 8 + 16k."""
    run = out.shape[1] // 16  # 16
    for b in range(blocks.shape[0]):
        d = _half(blocks, b, 0, half)
        tops = np.int32(blocks[b, 2]) | (np.int32(blocks[b, 3]) << 8)
        for k in range(8):
            low = (np.int32(blocks[b, 4 + (k >> 1)]) >> (4 * (k & 1))) & 15
            dl = d * np.float32((low | (((tops >> (2 * k)) & 3) << 4)) - 32)
            for i in range(run):
                byte = blocks[b, 8 + 16 * k + i]
                out[b, 32 * k + i] = dl * np.float32(_IQ4_VALUES[byte & 15])
                out[b, 32 * k + run + i] = dl * np.float32(_IQ4_VALUES[byte >> 4])


#: The types fused here, by code: the task calls their kernels through a chain of branches in this order (numba has
#: no table of functions). Those ComfyUI users' files hold, where the torch kernels pass over the output most.
_TYPES_BY_CODE = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K,
                  QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS)
TYPES = frozenset(_TYPES_BY_CODE)
_CODES = {qtype: code for code, qtype in enumerate(_TYPES_BY_CODE)}
_TYPE_SIZES = tuple(gguf.GGML_QUANT_SIZES[qtype][1] for qtype in _TYPES_BY_CODE)
_BLOCK_SIZES = tuple(gguf.GGML_QUANT_SIZES[qtype][0] for qtype in _TYPES_BY_CODE)


@intrinsic
def _pointer(typingctx, address):
    """An integer address as a pointer, for `numba.carray`."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@intrinsic
def _fetch_add(typingctx, address, value):
    """Atomically add `value` to the int64 at `address`; returns what was there."""

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", pointer, args[1], "monotonic")

    return types.int64(types.int64, types.int64), codegen


def _task(data):
    """The work of one thread: claims ranges of `chunk` blocks from a shared counter until none is left, and expands
    each with its type's kernel. `data` is the call's descriptor, int64: blocks, output and half-table addresses,
    blocks, the type's code, chunk, counter."""
    call = numba.carray(data, (7,), dtype=np.int64)
    n, code, chunk = call[3], call[4], call[5]
    blocks = numba.carray(_pointer(call[0]), (n, _TYPE_SIZES[code]), dtype=np.uint8)
    out = numba.carray(_pointer(call[1]), (n, _BLOCK_SIZES[code]), dtype=np.float32)
    half = numba.carray(_pointer(call[2]), (1 << 16,), dtype=np.float32)
    counter = call.ctypes.data + 6 * 8
    start = _fetch_add(counter, chunk)
    while start < n:
        ours, values = blocks[start : start + chunk], out[start : start + chunk]
        if code == 0:
            _q8_0(ours, values, half)
        elif code == 1:
            _q4_0(ours, values, half)
        elif code == 2:
            _q4_1(ours, values, half)
        elif code == 3:
            _q5_0(ours, values, half)
        elif code == 4:
            _q5_1(ours, values, half)
        elif code == 5:
            _q2_k(ours, values, half)
        elif code == 6:
            _q3_k(ours, values, half)
        elif code == 7:
            _q4_k(ours, values, half)
        elif code == 8:
            _q5_k(ours, values, half)
        elif code == 9:
            _q6_k(ours, values, half)
        elif code == 10:
            _iq4_nl(ours, values, half)
        else:
            _iq4_xs(ours, values, half)
        start = _fetch_add(counter, chunk)


_DEQUANTIZE = _compiled_task(_task)


def dequantize(qtype: QType, blocks: np.ndarray, out: np.ndarray, half: np.ndarray) -> None:
    """Fill `out` (n_blocks, block_size) float32 from `blocks` (n_blocks, type_size) uint8, both C-contiguous, on as
    many of torch's threads as it uses (fewer for a small tensor), each claiming ranges of blocks as it goes.
    `half` is numpy's widening of every float16 (65536 float32). The native task trusts these shapes: checked here."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = blocks.shape[0]
    for array, dtype, shape in ((blocks, np.uint8, (n, type_size)), (out, np.float32, (n, block_size)),
                                (half, np.float32, (1 << 16,))):
        if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
            raise QuantError(f"{qtype.name} dequant needs C-contiguous {np.dtype(dtype)} arrays of {shape}, got "
                             f"{array.dtype} {array.shape}{'' if array.flags.c_contiguous else ' (strided)'}")
    threads = max(1, min(torch.get_num_threads(), n // _BLOCKS_PER_THREAD))
    chunk = max(_BLOCKS_PER_THREAD // 4, -(-n // (4 * threads)))
    call = np.array([blocks.ctypes.data, out.ctypes.data, half.ctypes.data, n, _CODES[qtype], chunk, 0], np.int64)
    torch_openmp.run(_DEQUANTIZE.address, call.ctypes.data, threads)
