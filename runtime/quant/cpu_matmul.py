"""Matmuls that read quantized weights where they lie, on the CPU, in llama.cpp's arithmetic: GGUF blocks (Q8_0,
Q4_0, Q4_K, Q5_K, Q6_K; Q4_K_M is Q4_K and Q6_K) and ConvRot INT4 storage.

Expanding a quantized weight into floats before each matmul writes eight times its size and reads it back: 15-30×
slower per matmul than llama.cpp, which never expands. Its kernels quantize the activations to int8 per block of 32
instead (one float scale each) and take integer dot products of those with the weight's own quants, scaling each
block's sum by both scales. These kernels do the same, reading the raw blocks in place (the resident's storage, a
mapped file's pages), so a weight needs no float copy at all.

The loops are numba's; the arithmetic of one 32-value chunk is LLVM vector code written here (`_chunk_dot`), since
numba widens every integer product to 64 bits and never reaches the byte-pair instructions the speed comes from. On
x86 with AVX2 it is llama.cpp's instruction sequence (`psign`, `pmaddubsw`, `pmaddwd`); elsewhere (ARM, older x86)
plain vector IR that LLVM lowers for the machine, with the same integer sums: no pair sum saturates, since the
activations stay within ±127. Each layout's decoder (`LAYOUTS`) turns a block into chunks of 32 signed int8 values
with integer sub-block scales, a float scale, and for Q4_K/Q5_K a float offset per chunk (their `- dmin * m`), applied
through the chunk's activation sum, as llama.cpp does. Activations take one scale per weight block (32 values for
Q8_0/Q4_0, 64 for ConvRot INT4, 256 for the K-quants: llama.cpp's Q8_0 and Q8_K), so a block's chunks add their
integer sums before its two scales multiply them once.

Arithmetic and bound: the result differs from dequantize → `F.linear` in float32 by the activations' rounding to 8
bits, as llama.cpp's does: relative L2 about 5e-3 per layer on random data, no worse than ggml's own on the same
blocks (the K-quants' integer sums are ggml's own; its Q8_0 activation scales are float16, these float32). ConvRot
INT4 rotates the activations first, as its float route does. Each output is summed in one fixed order by one thread:
the same bits on any number of threads. NaN or infinite activations or scales make the outputs they reach
non-finite, as in float arithmetic (their values may differ: an infinite activation gives NaN here).

Threads: a call runs on torch's own OpenMP workers (`torch_openmp`), which claim ranges of output rows from a shared
counter; four activation rows share each decoded weight chunk, so prefill decodes a weight once per four tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import llvmlite.binding
import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from torch import Tensor

from . import torch_openmp
from .errors import QuantError
from .gguf_fused_cpu import _compiled_task, _fetch_add, _pointer

QType = gguf.GGMLQuantizationType

_I8, _I16, _I32, _I64, _F16, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.HalfType(),
                                     ir.FloatType())
CHUNK = 32
"""Values per chunk: the unit of the vector arithmetic, and the activation sums kept for Q4_K/Q5_K's offsets."""
_ROWS_TOGETHER = 4
"""Activation rows multiplied by each decoded weight chunk before the next is decoded."""
_ROWS_PER_CLAIM = 16
"""The fewest output rows a thread claims at once."""
_CLAIMS_PER_THREAD = 4
"""About how many claims each thread makes: few, so that each reads long runs of weight rows from memory (a
decode reads them from memory, not cache), yet enough that the last claims even out the threads' shares."""
_BYTES_PER_THREAD = 1 << 18
"""Weight bytes (times activation rows) below which another thread costs more to start than it saves."""


def _vector(element: ir.Type, count: int) -> ir.VectorType:
    return ir.VectorType(element, count)


def _lanes(b: ir.IRBuilder, value: ir.Value, picks) -> ir.Value:
    picks = list(picks)
    return b.shuffle_vector(value, value, ir.Constant(_vector(_I32, len(picks)), picks))


def _splat(b: ir.IRBuilder, scalar: ir.Value, count: int) -> ir.Value:
    one = b.insert_element(ir.Constant(_vector(scalar.type, 1), ir.Undefined), scalar, ir.Constant(_I32, 0))
    return _lanes(b, one, [0] * count)


def _constant(element: ir.Type, count: int, value: int) -> ir.Constant:
    return ir.Constant(_vector(element, count), [value] * count)


def _load(b: ir.IRBuilder, address: ir.Value, offset: int, of: ir.Type) -> ir.Value:
    """The `of` at byte `offset` from integer `address` (no alignment assumed)."""
    at = b.add(address, ir.Constant(_I64, offset)) if offset else address
    return b.load(b.inttoptr(at, of.as_pointer()), align=1)


def _half(b: ir.IRBuilder, address: ir.Value, offset: int) -> ir.Value:
    return b.fpext(_load(b, address, offset, _F16), _F32)


def _bits(b: ir.IRBuilder, value: ir.Value, shift: int, mask: int) -> ir.Value:
    """(value >> shift) & mask, lane by lane, for a vector of bytes or one byte."""
    count = getattr(value.type, "count", None)
    constant = (lambda v: _constant(_I8, count, v)) if count else (lambda v: ir.Constant(_I8, v))
    return b.and_(b.lshr(value, constant(shift)) if shift else value, constant(mask))


def _host_route() -> str:
    """`avx2` where the machine code numba makes may use AVX2 (x86), else `vector` (plain vector IR)."""
    features = numba.config.CPU_FEATURES or llvmlite.binding.get_host_cpu_features().flatten()
    return "avx2" if "+avx2" in features.split(",") else "vector"


ROUTE = _host_route()


def _x86(b: ir.IRBuilder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    function = cgutils.get_or_insert_function(b.module, ir.FunctionType(result, [a.type for a in args]),
                                              f"llvm.x86.avx2.{name}")
    return b.call(function, args)


def _chunk_dot(b: ir.IRBuilder, values: ir.Value, x: ir.Value, scales: ir.Value, unsigned: bool, route: str
               ) -> ir.Value:
    """Σ values · x · scale over a chunk, as 8 int32 partial sums (lane l: values 4l..4l+3): `values` and `x` are
    32 bytes (`values` signed, or non-negative below 128 where `unsigned`: no sign to move onto x), `scales` 16 int16
    (one per value pair). The `avx2` route and the `vector` one give the same sums."""
    if route == "avx2":
        if not unsigned:  # pmaddubsw multiplies unsigned by signed: |values| by x with values' signs
            values, x = _x86(b, "psign.b", values.type, values, values), _x86(b, "psign.b", x.type, x, values)
        pairs = _x86(b, "pmadd.ub.sw", _vector(_I16, 16), values, x)
        return _x86(b, "pmadd.wd", _vector(_I32, 8), pairs, scales)
    wide = _vector(_I32, CHUNK)
    products = b.mul((b.zext if unsigned else b.sext)(values, wide), b.sext(x, wide))
    products = b.mul(products, b.sext(_lanes(b, scales, [i // 2 for i in range(CHUNK)]), wide))
    quads = [_lanes(b, products, range(k, CHUNK, 4)) for k in range(4)]
    return b.add(b.add(quads[0], quads[1]), b.add(quads[2], quads[3]))


class _Block:
    """One decoded block: its chunks of 32 int8 values (signed, or all non-negative where `unsigned`), 16 int16
    scales per chunk (one per value pair), the float scale of every chunk's sum, and for Q4_K/Q5_K the float offset of
    each chunk per unit of activation (their `dmin · m`, subtracted; None where a type has none)."""

    def __init__(self, values, scales, scale, offsets=None, unsigned=False):
        self.values, self.scales, self.scale, self.offsets, self.unsigned = values, scales, scale, offsets, unsigned


def _ones() -> ir.Constant:
    return _constant(_I16, 16, 1)


def _q8_0(b, block, scale_at):
    return _Block([_load(b, block, 2, _vector(_I8, 32))], [_ones()], _half(b, block, 0))


def _q4_0(b, block, scale_at):
    quants = _load(b, block, 2, _vector(_I8, 16))
    both = b.shuffle_vector(_bits(b, quants, 0, 15), _bits(b, quants, 4, 15),
                            ir.Constant(_vector(_I32, 32), list(range(32))))
    return _Block([b.sub(both, _constant(_I8, 32, 8))], [_ones()], _half(b, block, 0))


def _k4_scales_and_mins(b, block):
    """The 8 scales and 8 mins of a Q4_K/Q5_K block (6 bits each, packed in its 12 bytes at byte 4) as 16 bytes,
    scales first: llama.cpp's unpacking, on the three little-endian words."""
    words = [_load(b, block, 4 + 4 * i, _I32) for i in range(3)]
    mask = lambda word, shift, bits: b.and_(b.lshr(word, ir.Constant(_I32, shift)) if shift else word,  # noqa: E731
                                            ir.Constant(_I32, bits))
    low6, low4, top2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    unpacked = [mask(words[0], 0, low6),
                b.or_(mask(words[2], 0, low4), b.shl(mask(words[0], 6, top2), ir.Constant(_I32, 4))),
                mask(words[1], 0, low6),
                b.or_(mask(words[2], 4, low4), b.shl(mask(words[1], 6, top2), ir.Constant(_I32, 4)))]
    vector = ir.Constant(_vector(_I32, 4), None)
    for i, word in enumerate(unpacked):
        vector = b.insert_element(vector, word, ir.Constant(_I32, i))
    return b.bitcast(vector, _vector(_I8, 16))


def _k_quant(b, block, quants_at, top_bit):
    """Q4_K (`top_bit` False) and Q5_K: chunk j is nibble j & 1 of the 32 quant bytes at quants_at + 32 (j >> 1),
    for Q5_K topped by bit j of the 32 qh bytes at 16."""
    d, dmin = _half(b, block, 0), _half(b, block, 2)
    packed = b.zext(_k4_scales_and_mins(b, block), _vector(_I16, 16))
    values = []
    for j in range(8):
        chunk = _bits(b, _load(b, block, quants_at + 32 * (j >> 1), _vector(_I8, 32)), 4 * (j & 1), 15)
        if top_bit:
            top = _bits(b, _load(b, block, 16, _vector(_I8, 32)), j, 1)
            chunk = b.or_(chunk, b.shl(top, _constant(_I8, 32, 4)))
        values.append(chunk)
    scales = [_lanes(b, packed, [j] * 16) for j in range(8)]
    mins = b.uitofp(_lanes(b, packed, range(8, 16)), _vector(_F32, 8))
    return _Block(values, scales, d, b.fmul(mins, _splat(b, dmin, 8)), unsigned=True)


def _q4_k(b, block, scale_at):
    return _k_quant(b, block, 16, top_bit=False)


def _q5_k(b, block, scale_at):
    return _k_quant(b, block, 48, top_bit=True)


def _q6_k(b, block, scale_at):
    """Chunk c (h = c >> 2, j = c & 3) is nibble j >> 1 of the ql bytes at 64h + 32 (j & 1), topped by 2-bit field j
    of the qh bytes at 128 + 32h, less 32; its two halves take int8 scales 2c and 2c + 1 (at byte 192)."""
    values, scales = [], []
    all_scales = b.sext(_load(b, block, 192, _vector(_I8, 16)), _vector(_I16, 16))
    for c in range(8):
        h, j = c >> 2, c & 3
        low = _bits(b, _load(b, block, 64 * h + 32 * (j & 1), _vector(_I8, 32)), 4 * (j >> 1), 15)
        top = _bits(b, _load(b, block, 128 + 32 * h, _vector(_I8, 32)), 2 * j, 3)
        values.append(b.sub(b.or_(low, b.shl(top, _constant(_I8, 32, 4))), _constant(_I8, 32, 32)))
        scales.append(_lanes(b, all_scales, [2 * c] * 8 + [2 * c + 1] * 8))
    return _Block(values, scales, _half(b, block, 208))


def _convrot_int4(b, block, scale_at):
    """64 values in 32 bytes (one row's scale group): chunk c's values 2i and 2i + 1 are the low and high nibbles of
    byte 16c + i, less 8; the group's float32 scale is kept apart, at `scale_at` (the resident's `weight_scale`)."""
    values = []
    for c in range(2):
        quants = _load(b, block, 16 * c, _vector(_I8, 16))
        pairs = b.shuffle_vector(_bits(b, quants, 0, 15), _bits(b, quants, 4, 15),
                                 ir.Constant(_vector(_I32, 32), [i // 2 + 16 * (i % 2) for i in range(32)]))
        values.append(b.sub(pairs, _constant(_I8, 32, 8)))
    return _Block(values, [_ones()] * 2, b.load(b.inttoptr(scale_at, _F32.as_pointer()), align=4))


@dataclass(frozen=True)
class Layout:
    """How a quantized weight's rows are stored: blocks of `block_size` values in `type_size` bytes, each decoded by
    `decode(builder, block address, its scale's address)` (the second where the scales are kept apart)."""

    name: str
    block_size: int
    type_size: int
    decode: Callable
    scales_apart: bool = False


CONVROT_INT4 = "convrot_int4"
LAYOUTS: dict[object, Layout] = {
    **{qtype: Layout(qtype.name.lower(), *gguf.GGML_QUANT_SIZES[qtype], decode) for qtype, decode in (
        (QType.Q8_0, _q8_0), (QType.Q4_0, _q4_0), (QType.Q4_K, _q4_k), (QType.Q5_K, _q5_k), (QType.Q6_K, _q6_k))},
    CONVROT_INT4: Layout(CONVROT_INT4, 64, 32, _convrot_int4, scales_apart=True),
}
"""The layouts read here: GGML types by `QType`, ConvRot INT4 (with scale groups of 64) by `CONVROT_INT4`."""


def _rows_kernel(layout: Layout, rows: int, route: str):
    """An intrinsic `(weight_row, weight_scales, x, x_scales, x_sums, k_chunks, out, out_stride)` (all addresses but
    the counts) writing `rows` outputs: the dots of one weight row (its scales apart where the layout keeps them so)
    with `rows` activation rows (K bytes apart; one float32 scale per weight block, and the float32 sum of each chunk's
    values, k_chunks apart), to out + r · out_stride floats."""
    per_block, type_size = layout.block_size // CHUNK, layout.type_size

    def codegen(context, b, signature, args):
        weight, weight_scales, x, x_scales, x_sums, k_chunks, out, out_stride = args
        sums = [cgutils.alloca_once_value(b, ir.Constant(_vector(_F32, 8), None)) for _ in range(rows)]
        floats = lambda address, at, of=_F32: b.load(  # noqa: E731
            b.bitcast(b.gep(b.inttoptr(address, _F32.as_pointer()), [at]), of.as_pointer()), align=4)
        with cgutils.for_range(b, b.udiv(k_chunks, ir.Constant(_I64, per_block))) as loop:
            block = layout.decode(b, b.add(weight, b.mul(loop.index, ir.Constant(_I64, type_size))),
                                  b.add(weight_scales, b.mul(loop.index, ir.Constant(_I64, 4))))
            for r in range(rows):
                # the block's first chunk in activation row r, and that row's scale for it (one per block)
                chunk = b.add(b.mul(k_chunks, ir.Constant(_I64, r)), b.mul(loop.index, ir.Constant(_I64, per_block)))
                row_x = b.add(x, b.mul(chunk, ir.Constant(_I64, CHUNK)))
                x_scale = floats(x_scales, b.udiv(chunk, ir.Constant(_I64, per_block)))
                chunks = enumerate(zip(block.values, block.scales, strict=True))
                dots = [_chunk_dot(b, values, _load(b, row_x, CHUNK * c, _vector(_I8, 32)), scales, block.unsigned,
                                   route) for c, (values, scales) in chunks]
                while len(dots) > 1:  # the chunks' integer sums, added as a tree
                    dots = [b.add(*dots[i : i + 2]) for i in range(0, len(dots), 2)]
                scale = _splat(b, b.fmul(block.scale, x_scale), 8)
                total = b.fmul(b.sitofp(dots[0], _vector(_F32, 8)), scale)
                if block.offsets is not None:  # each chunk's offset times its activation sum, in 8 lanes
                    offsets = b.fmul(block.offsets, floats(x_sums, chunk, _vector(_F32, 8)))
                    total = b.fsub(total, b.fmul(offsets, _splat(b, x_scale, 8)))
                b.store(b.fadd(b.load(sums[r]), total), sums[r])
        outputs = b.inttoptr(out, _F32.as_pointer())
        for r in range(rows):
            v = b.load(sums[r])
            v = b.fadd(_lanes(b, v, range(4)), _lanes(b, v, range(4, 8)))
            v = b.fadd(_lanes(b, v, range(2)), _lanes(b, v, range(2, 4)))
            total = b.fadd(b.extract_element(v, ir.Constant(_I32, 0)), b.extract_element(v, ir.Constant(_I32, 1)))
            b.store(total, b.gep(outputs, [b.mul(out_stride, ir.Constant(_I64, r))]))
        return context.get_dummy_value()

    def typer(typingctx, weight, weight_scales, x, x_scales, x_sums, k_chunks, out, out_stride):
        return types.void(*([types.int64] * 8)), codegen

    return intrinsic(typer)


@functools.cache
def _task(layout: Layout, route: str = ROUTE):
    """The compiled work of one thread for weights in `layout`: claims ranges of output rows from the call's counter
    until none is left, and for each multiplies every activation row, four at a time.

    The call's descriptor, int64: weight, weight scales (or 0), activations, their scales, their sums, output
    addresses; M, N, K; the weight row's bytes; the rows of a claim; the counter."""
    together, single = _rows_kernel(layout, _ROWS_TOGETHER, route), _rows_kernel(layout, 1, route)
    block_size = layout.block_size

    def task(data):
        call = numba.carray(data, (12,), dtype=np.int64)
        weight, weight_scales, x, x_scales, x_sums, out = call[0], call[1], call[2], call[3], call[4], call[5]
        m, n, k, row_bytes, claim = call[6], call[7], call[8], call[9], call[10]
        k_chunks, k_groups = k // CHUNK, k // block_size
        counter = call.ctypes.data + 11 * 8
        start = _fetch_add(counter, claim)
        while start < n:
            for row in range(start, min(start + claim, n)):
                w, w_scales = weight + row * row_bytes, weight_scales + row * k_groups * 4
                first = 0
                while first + _ROWS_TOGETHER <= m:
                    together(w, w_scales, x + first * k, x_scales + first * k_groups * 4,
                             x_sums + first * k_chunks * 4, k_chunks, out + (first * n + row) * 4, n)
                    first += _ROWS_TOGETHER
                while first < m:
                    single(w, w_scales, x + first * k, x_scales + first * k_groups * 4, x_sums + first * k_chunks * 4,
                           k_chunks, out + (first * n + row) * 4, n)
                    first += 1
            start = _fetch_add(counter, claim)

    task.__name__ = task.__qualname__ = f"matmul_{layout.name}_{route}"  # numba caches each on its own
    return _compiled_task(task)


@numba.njit(inline="always")
def _quantize_row(x, values, scales, sums):
    """One float32 row into int8 groups (as many as `scales`): each scaled so its largest magnitude is 127, rounded
    to nearest (ties to even), as llama.cpp's Q8_0 and Q8_K; each chunk of 32's sum of values in `sums`. A group
    holding NaN or an infinity gets a NaN scale, so every output it reaches is NaN."""
    group = x.shape[0] // scales.shape[0]
    for g in range(scales.shape[0]):
        amax, probe = np.float32(0), np.float32(0)
        for i in range(g * group, (g + 1) * group):
            amax = max(amax, abs(x[i]))
            probe += x[i] - x[i]  # 0, or NaN where a value is NaN or infinite
        inverse = np.float32(127) / amax if amax > 0 and probe == 0 else np.float32(0)
        for i in range(g * group, (g + 1) * group):
            values[i] = np.int8(np.rint(x[i] * inverse))
        scales[g] = amax / np.float32(127) + probe
    for c in range(sums.shape[0]):
        total = 0
        for i in range(c * CHUNK, (c + 1) * CHUNK):
            total += values[i]
        sums[c] = np.float32(total)


def _quantize_task(data):
    """The compiled work of one thread quantizing activation rows claimed from the call's counter. Descriptor, int64:
    rows, values, scales, sums addresses; M, K, the group size; the counter."""
    call = numba.carray(data, (8,), dtype=np.int64)
    m, k, group = call[4], call[5], call[6]
    rows = numba.carray(_pointer(call[0]), (m, k), dtype=np.float32)
    values = numba.carray(_pointer(call[1]), (m, k), dtype=np.int8)
    scales = numba.carray(_pointer(call[2]), (m, k // group), dtype=np.float32)
    sums = numba.carray(_pointer(call[3]), (m, k // CHUNK), dtype=np.float32)
    counter = call.ctypes.data + 7 * 8
    row = _fetch_add(counter, 1)
    while row < m:
        _quantize_row(rows[row], values[row], scales[row], sums[row])
        row = _fetch_add(counter, 1)


_QUANTIZE = _compiled_task(_quantize_task)


def quantize_activations(rows: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """(int8 values, float32 scale per group, float32 sum of each chunk of 32 values) of float32 rows (M, K)."""
    m, k = rows.shape
    buffer, _ = _quantized(rows.contiguous(), group)
    values, scales = np.split(buffer, [m * k])
    scales, sums = np.split(scales.view(np.float32), [m * (k // group)])
    return (torch.from_numpy(values).reshape(m, k), torch.from_numpy(scales).reshape(m, -1),
            torch.from_numpy(sums).reshape(m, -1))


def _quantized(rows: Tensor, group: int) -> tuple[np.ndarray, int]:
    """The activations quantized into one buffer (values, then scales, then sums) and its address: one allocation,
    since a decode step quantizes once per Linear."""
    m, k = rows.shape
    buffer = np.empty(m * k + 4 * m * (k // group + k // CHUNK), np.int8)
    address = buffer.ctypes.data
    call = np.array([rows.data_ptr(), address, address + m * k, address + m * k + 4 * m * (k // group), m, k, group,
                     0], np.int64)
    torch_openmp.run(_QUANTIZE.address, call.ctypes.data, min(torch.get_num_threads(), m))
    return buffer, address


def matmul(rows: Tensor, storage: Tensor, layout: object, out_features: int, weight_scales: Tensor | None = None,
           route: str = ROUTE) -> Tensor:
    """rows (M, K) float · Wᵀ, W the (out_features, K) weight held on the CPU as `storage` (uint8 or int8 bytes) in
    `layout` (a key of `LAYOUTS`), with its float32 `weight_scales` (out_features, K / block) where the layout keeps
    them apart: (M, out_features) float32. `route` is for tests: the `vector` route runs on any machine."""
    m, k = rows.shape
    found = LAYOUTS[layout]
    row_bytes, groups = k // found.block_size * found.type_size, k // found.block_size
    if k % found.block_size or storage.numel() * storage.element_size() != out_features * row_bytes:
        raise QuantError(f"{found.name} storage of {storage.numel()} {storage.dtype} does not hold a "
                         f"{out_features}×{k} weight")
    if found.scales_apart != (weight_scales is not None) or (
            weight_scales is not None and tuple(weight_scales.shape) != (out_features, groups)):
        wanted = f"scales of shape {(out_features, groups)}" if found.scales_apart else "no scales apart"
        raise QuantError(f"{found.name} weights take {wanted}")
    storage = storage.contiguous()
    scales = None if weight_scales is None else weight_scales.float().contiguous()
    buffer, values = _quantized(rows.float().contiguous(), found.block_size)
    x_scales = values + m * k
    out = torch.empty(m, out_features, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), out_features // _ROWS_PER_CLAIM,
                         1 + m * storage.nbytes // _BYTES_PER_THREAD))
    claim = max(_ROWS_PER_CLAIM, -(-out_features // (_CLAIMS_PER_THREAD * threads)))
    call = np.array([storage.data_ptr(), 0 if scales is None else scales.data_ptr(), values, x_scales,
                     x_scales + 4 * m * groups, out.data_ptr(), m, out_features, k, row_bytes, claim, 0], np.int64)
    torch_openmp.run(_task(found, route).address, call.ctypes.data, threads)
    return out


_LIBRARY = torch.library.Library("streamwise", "FRAGMENT")
_LIBRARY.define("gguf_matmul(Tensor rows, Tensor blocks, int qtype, int out_features) -> Tensor")
"""`matmul` as an operator: a compiled graph calls it opaquely (its meta says the output's shape: no graph break),
and gradients reach the activations through the float weight (a LoRA trained over a GGUF model)."""


@torch.library.impl(_LIBRARY, "gguf_matmul", "CPU")
def _gguf_matmul_cpu(rows: Tensor, blocks: Tensor, qtype: int, out_features: int) -> Tensor:
    return matmul(rows, blocks, QType(qtype), out_features)


@torch.library.impl(_LIBRARY, "gguf_matmul", "Meta")  # also what fake tensors (compile's tracing) run
def _gguf_matmul_meta(rows: Tensor, blocks: Tensor, qtype: int, out_features: int) -> Tensor:
    return rows.new_empty((rows.shape[0], out_features), dtype=torch.float32)


def _gguf_matmul_context(ctx, inputs, output) -> None:
    rows, blocks, qtype, out_features = inputs
    ctx.rows_dtype, ctx.qtype, ctx.shape = rows.dtype, QType(qtype), (out_features, rows.shape[1])
    ctx.save_for_backward(blocks)


def _gguf_matmul_backward(ctx, grad: Tensor):
    from .gguf_dequant import dequantize

    (blocks,) = ctx.saved_tensors
    return grad.to(ctx.rows_dtype) @ dequantize(blocks, ctx.qtype, ctx.shape, ctx.rows_dtype), None, None, None


torch.library.register_autograd("streamwise::gguf_matmul", _gguf_matmul_backward, setup_context=_gguf_matmul_context)
