"""The Triton kernels of `gguf_triton`, one per GGML type (imported only where Triton is available, and only once
asked for: Triton reads `TRITON_INTERPRET` as a kernel is defined). Each program expands `BLOCKS` blocks; the
byte layouts are gguf's (`gguf.quants`), the arithmetic the torch kernels' (`gguf_torch_kernels`), operation for
operation."""

from __future__ import annotations

import gguf
import triton
import triton.language as tl


@triton.jit
def half(blocks, base, offset, mask):
    """The little-endian float16 at byte `offset` of each block, widened to float32."""
    low = tl.load(blocks + base + offset, mask=mask, other=0).to(tl.uint16)
    high = tl.load(blocks + base + offset + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def nibbles(blocks, base, offset, mask):
    """The 32 four-bit values of 16 bytes at `offset`: low nibbles first (values 0-15), then high ones."""
    j = tl.arange(0, 32)
    packed = tl.load(blocks + base[:, None] + offset + (j % 16)[None, :], mask=mask[:, None], other=0)
    return ((packed >> (4 * (j // 16))[None, :]) & 0x0F).to(tl.int32)


@triton.jit
def fifth_bits(blocks, base, offset, mask):
    """Bit 4 of each of 32 values: bit i of the little-endian u32 at `offset`, for value i."""
    j = tl.arange(0, 32)
    byte = tl.load(blocks + base[:, None] + offset + (j // 8)[None, :], mask=mask[:, None], other=0)
    return (((byte >> (j % 8)[None, :]) & 1) << 4).to(tl.int32)


@triton.jit
def store(out, first, values, mask, VALUES: tl.constexpr = 32):
    """Float32 `values` into `VALUES` values a block of `out`, rounded to its dtype to nearest, ties to even."""
    j = tl.arange(0, VALUES)
    tl.store(out + first[:, None] * VALUES + j[None, :], cast(values, out), mask=mask[:, None])


@triton.jit
def cast(values, out):
    """Float32 `values` in the dtype `out` points to, rounded to nearest, ties to even."""
    if out.dtype.element_ty == tl.bfloat16:
        rounded = bfloat16(values)
    else:
        rounded = values.to(out.dtype.element_ty)
    return rounded


@triton.jit
def bfloat16(values):
    """Float32 to bfloat16 rounded to nearest, ties to even, from the bits (as the GPU converts; Triton's
    interpreter truncates), a NaN as the canonical one."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    rounded = tl.where(values != values, 0x7FC0, rounded).to(tl.uint16)
    return rounded.to(tl.bfloat16, bitcast=True)


@triton.jit
def q8_0_values(blocks, base, mask):
    """34 bytes: d (f16), 32 int8 quants; value = d * q."""
    j = tl.arange(0, 32)
    q = tl.load(blocks + base[:, None] + 2 + j[None, :], mask=mask[:, None], other=0).to(tl.int8, bitcast=True)
    return q.to(tl.float32) * half(blocks, base, 0, mask)[:, None]


@triton.jit
def q4_0_values(blocks, base, mask):
    """18 bytes: d (f16), 16 bytes of nibbles; value = d * (q - 8)."""
    q = (nibbles(blocks, base, 2, mask) - 8).to(tl.float32)
    return q * half(blocks, base, 0, mask)[:, None]


@triton.jit
def q4_1_values(blocks, base, mask):
    """20 bytes: d (f16), m (f16), 16 bytes of nibbles; value = m + d * q."""
    q = nibbles(blocks, base, 4, mask).to(tl.float32)
    scaled = q * half(blocks, base, 0, mask)[:, None]
    return half(blocks, base, 2, mask)[:, None] + scaled


@triton.jit
def q5_0_values(blocks, base, mask):
    """22 bytes: d (f16), qh (u32: bit 4 of value i at bit i), 16 bytes of low nibbles; value = d * (q - 16)."""
    q = (nibbles(blocks, base, 6, mask) + fifth_bits(blocks, base, 2, mask) - 16).to(tl.float32)
    return q * half(blocks, base, 0, mask)[:, None]


@triton.jit
def q5_1_values(blocks, base, mask):
    """24 bytes: d (f16), m (f16), qh (u32), 16 bytes of low nibbles; value = m + d * q."""
    q = (nibbles(blocks, base, 8, mask) + fifth_bits(blocks, base, 4, mask)).to(tl.float32)
    scaled = q * half(blocks, base, 0, mask)[:, None]
    return half(blocks, base, 2, mask)[:, None] + scaled



@triton.jit
def k4_affine(blocks, base, mask, q):
    """The values of a Q4_K/Q5_K block from its quants `q` (BLOCKS, 256): -(dmin * min) + q * (d * scale), with
    eight 6-bit scales and mins, one a 32-value sub-block, in the 12 bytes at byte 4 (bytes 0-3 / 4-7: scales /
    mins 0-3 in their low 6 bits, the top 2 bits of 4-7 in their high 2; bytes 8-11: the low 4 bits of scales 4-7,
    low nibble, and of mins 4-7, high nibble)."""
    sub = tl.arange(0, 256) // 32
    k = (sub % 4)[None, :]
    at = base[:, None] + 4
    low, mins, mixed = (tl.load(blocks + at + k, mask=mask[:, None], other=0),
                        tl.load(blocks + at + 4 + k, mask=mask[:, None], other=0),
                        tl.load(blocks + at + 8 + k, mask=mask[:, None], other=0))
    upper = (sub >= 4)[None, :]
    scale = tl.where(upper, (mixed & 0x0F) | ((low >> 2) & 0x30), low & 0x3F).to(tl.float32)
    least = tl.where(upper, (mixed >> 4) | ((mins >> 2) & 0x30), mins & 0x3F).to(tl.float32)
    d, dmin = half(blocks, base, 0, mask)[:, None], half(blocks, base, 2, mask)[:, None]
    return -dmin * least + q.to(tl.float32) * (d * scale)


@triton.jit
def k4_nibbles(blocks, base, mask, offset):
    """The 256 four-bit quants of a Q4_K/Q5_K block from the 128 bytes at `offset`: each 32 bytes hold 64 values,
    low nibbles first."""
    v = tl.arange(0, 256)
    sub = v // 32
    packed = tl.load(blocks + base[:, None] + offset + (32 * (sub // 2) + v % 32)[None, :], mask=mask[:, None],
                     other=0)
    return ((packed >> (4 * (sub % 2))[None, :]) & 0x0F).to(tl.int32)


@triton.jit
def q4_k_values(blocks, base, mask):
    """144 bytes: d, dmin (f16), 12 scale bytes (`k4_affine`), 128 bytes of nibbles (`k4_nibbles`)."""
    return k4_affine(blocks, base, mask, k4_nibbles(blocks, base, mask, 16))


@triton.jit
def q5_k_values(blocks, base, mask):
    """176 bytes: d, dmin (f16), 12 scale bytes, qh (32: bit j of byte i is bit 4 of value 32 * j + i), 128 bytes
    of nibbles laid out as in Q4_K."""
    v = tl.arange(0, 256)
    qh = tl.load(blocks + base[:, None] + 16 + (v % 32)[None, :], mask=mask[:, None], other=0)
    q = k4_nibbles(blocks, base, mask, 48) + (((qh >> (v // 32)[None, :]) & 1) << 4).to(tl.int32)
    return k4_affine(blocks, base, mask, q)


@triton.jit
def two_bits(blocks, base, mask, offset):
    """The 256 two-bit quants at `offset` (64 bytes): each 32-byte half holds 128 values, 2-bit field j of byte i
    being value 32 * j + i."""
    v = tl.arange(0, 256)
    packed = tl.load(blocks + base[:, None] + offset + (32 * (v // 128) + v % 32)[None, :], mask=mask[:, None],
                     other=0)
    return ((packed >> (2 * ((v % 128) // 32))[None, :]) & 0x03).to(tl.int32)


@triton.jit
def q2_k_values(blocks, base, mask):
    """84 bytes: 16 scale bytes (a 16-value group's: low nibble scale, high nibble min), 64 bytes of 2-bit quants,
    d, dmin (f16); value = -(dmin * min) + q * (d * scale)."""
    v = tl.arange(0, 256)
    scales = tl.load(blocks + base[:, None] + (v // 16)[None, :], mask=mask[:, None], other=0)
    d, dmin = half(blocks, base, 80, mask)[:, None], half(blocks, base, 82, mask)[:, None]
    q = two_bits(blocks, base, mask, 16).to(tl.float32)
    return -dmin * (scales >> 4).to(tl.float32) + q * (d * (scales & 0x0F).to(tl.float32))


@triton.jit
def q3_k_values(blocks, base, mask):
    """110 bytes: hmask (32: bit j of byte i belongs to value 32 * j + i; a clear bit subtracts 4), 2-bit quants
    (64, as in Q2_K), 12 scale bytes (sixteen 6-bit scales less 32: the low 4 bits in the nibbles of bytes 0-7, low
    nibbles first, the top 2 in the 2-bit fields of bytes 8-11, field j of byte i being scale 4 * j + i), d (f16);
    value = (d * scale) * q."""
    v = tl.arange(0, 256)
    hmask = tl.load(blocks + base[:, None] + (v % 32)[None, :], mask=mask[:, None], other=0)
    q = two_bits(blocks, base, mask, 32) + 4 * ((hmask >> (v // 32)[None, :]) & 1).to(tl.int32) - 4
    group = v // 16
    low = tl.load(blocks + base[:, None] + 96 + (group % 8)[None, :], mask=mask[:, None], other=0)
    high = tl.load(blocks + base[:, None] + 104 + (group % 4)[None, :], mask=mask[:, None], other=0)
    scale = (((low >> (4 * (group // 8))[None, :]) & 0x0F) | (((high >> (2 * (group // 4))[None, :]) & 0x03) << 4))
    scale = (scale.to(tl.int32) - 32).to(tl.float32)
    return q.to(tl.float32) * (half(blocks, base, 108, mask)[:, None] * scale)


@triton.jit
def q6_k_values(blocks, base, mask):
    """210 bytes: ql (128), qh (64), 16 int8 scales, d (f16). Per 128-value half: nibble j of ql byte i (64 bytes)
    is value 64 * j + i, 2-bit field j of qh byte i (32 bytes) the top 2 bits of value 32 * j + i; a scale per 16
    values; value = (d * scale) * (q - 32)."""
    v = tl.arange(0, 256)
    within = v % 128
    ql = tl.load(blocks + base[:, None] + (64 * (v // 128) + within % 64)[None, :], mask=mask[:, None], other=0)
    qh = tl.load(blocks + base[:, None] + 128 + (32 * (v // 128) + within % 32)[None, :], mask=mask[:, None], other=0)
    low = (ql >> (4 * (within // 64))[None, :]) & 0x0F
    high = (qh >> (2 * (within // 32))[None, :]) & 0x03
    q = ((low | (high << 4)).to(tl.int32) - 32).to(tl.float32)
    scale = tl.load(blocks + base[:, None] + 192 + (v // 16)[None, :], mask=mask[:, None], other=0)
    scale = scale.to(tl.int8, bitcast=True).to(tl.float32)
    return q * (half(blocks, base, 208, mask)[:, None] * scale)



def _bytes_word(values) -> tl.constexpr:
    """Eight small signed integers as the bytes of one int64, lowest first: a table a kernel reads by shifts."""
    word = sum((int(value) & 0xFF) << (8 * i) for i, value in enumerate(values))
    return tl.constexpr(word - (1 << 64) if word >= 1 << 63 else word)


IQ4_LOW, IQ4_HIGH = _bytes_word(gguf.quants.IQ4_NL.kvalues[:8]), _bytes_word(gguf.quants.IQ4_NL.kvalues[8:])
MXFP4_LOW, MXFP4_HIGH = _bytes_word(gguf.quants.MXFP4.kvalues[:8]), _bytes_word(gguf.quants.MXFP4.kvalues[8:])


@triton.jit
def table16(q, LOW: tl.constexpr, HIGH: tl.constexpr):
    """The float32 value of each index 0-15 of `q` in a table of 16 signed bytes held as two int64 words."""
    word = tl.where(q < 8, tl.full(q.shape, LOW, tl.int64), tl.full(q.shape, HIGH, tl.int64))
    return ((word >> (8 * (q % 8)).to(tl.int64)) & 0xFF).to(tl.int8).to(tl.float32)


@triton.jit
def iq4_nl_values(blocks, base, mask):
    """18 bytes: d (f16), 16 bytes whose nibbles (low ones values 0-15) index IQ4_NL's table; value = table * d."""
    return table16(nibbles(blocks, base, 2, mask), IQ4_LOW, IQ4_HIGH) * half(blocks, base, 0, mask)[:, None]


@triton.jit
def iq4_xs_values(blocks, base, mask):
    """136 bytes: d (f16), a u16 of 2-bit scale tops, 4 bytes of 4-bit scale bottoms (a 32-value group's), then 128
    bytes laid out as eight IQ4_NL blocks without d; value = table * (d * (scale - 32))."""
    v = tl.arange(0, 256)
    group = v // 32
    low = tl.load(blocks + base[:, None] + 4 + (group // 2)[None, :], mask=mask[:, None], other=0)
    high = tl.load(blocks + base[:, None] + 2 + (group // 4)[None, :], mask=mask[:, None], other=0)
    scale = ((low >> (4 * (group % 2))[None, :]) & 0x0F) | (((high >> (2 * (group % 4))[None, :]) & 0x03) << 4)
    scale = (scale.to(tl.int32) - 32).to(tl.float32)
    packed = tl.load(blocks + base[:, None] + 8 + (16 * group + v % 16)[None, :], mask=mask[:, None], other=0)
    q = ((packed >> (4 * ((v % 32) // 16))[None, :]) & 0x0F).to(tl.int32)
    return table16(q, IQ4_LOW, IQ4_HIGH) * (half(blocks, base, 0, mask)[:, None] * scale)


@triton.jit
def mxfp4_values(blocks, base, mask):
    """17 bytes: an E8M0 exponent e, 16 bytes of E2M1 nibbles (doubled, as ggml keeps them), low then high;
    value = table * 2^(e - 128) (a float32 subnormal for e < 2)."""
    e = tl.load(blocks + base, mask=mask, other=0).to(tl.int32)
    bits = tl.where(e < 2, (e + 1) << 21, (e - 1) << 23)
    return table16(nibbles(blocks, base, 1, mask), MXFP4_LOW, MXFP4_HIGH) * bits.to(tl.float32, bitcast=True)[:, None]


Q = gguf.GGMLQuantizationType
VALUES = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32, Q.IQ4_NL: 32, Q.MXFP4: 32,
          Q.Q2_K: 256, Q.Q3_K: 256, Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256, Q.IQ4_XS: 256}
"""The types these kernels have, by GGML type, and the values of a block of each."""


@triton.jit
def values(blocks, base, mask, QTYPE: tl.constexpr):
    """The float32 values (len(base), block size) of the blocks of type `QTYPE` (a GGML type number) at `base`."""
    if QTYPE == 8:
        return q8_0_values(blocks, base, mask)
    elif QTYPE == 2:
        return q4_0_values(blocks, base, mask)
    elif QTYPE == 3:
        return q4_1_values(blocks, base, mask)
    elif QTYPE == 6:
        return q5_0_values(blocks, base, mask)
    elif QTYPE == 7:
        return q5_1_values(blocks, base, mask)
    elif QTYPE == 10:
        return q2_k_values(blocks, base, mask)
    elif QTYPE == 11:
        return q3_k_values(blocks, base, mask)
    elif QTYPE == 12:
        return q4_k_values(blocks, base, mask)
    elif QTYPE == 13:
        return q5_k_values(blocks, base, mask)
    elif QTYPE == 14:
        return q6_k_values(blocks, base, mask)
    elif QTYPE == 20:
        return iq4_nl_values(blocks, base, mask)
    elif QTYPE == 23:
        return iq4_xs_values(blocks, base, mask)
    else:
        return mxfp4_values(blocks, base, mask)


@triton.jit
def dequantize(blocks, out, n_blocks, type_size, QTYPE: tl.constexpr, VALUES: tl.constexpr, BLOCKS: tl.constexpr):
    """`BLOCKS` blocks a program, each block's values written once into `out` in its dtype."""
    first = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    mask = first < n_blocks
    store(out, first.to(tl.int64), values(blocks, first.to(tl.int64) * type_size, mask, QTYPE), mask, VALUES)


@triton.jit
def matmul(x, blocks, out, rows, out_features, k_blocks, type_size, QTYPE: tl.constexpr, VALUES: tl.constexpr,
           ROWS: tl.constexpr, FEATURES: tl.constexpr):
    """out (rows, out_features) float32 = x (rows, k_blocks * VALUES) · Wᵀ, W's rows GGML blocks (out_features,
    k_blocks): a program computes `FEATURES` output features of every row (`ROWS`, a power of two, at least
    `rows`), a block of each at a time expanded in registers, never written, the products summed in float32."""
    n = tl.program_id(0) * FEATURES + tl.arange(0, FEATURES)
    n_mask = n < out_features
    r = tl.arange(0, ROWS)
    r_mask = r < rows
    j = tl.arange(0, VALUES)
    in_features = k_blocks * VALUES
    total = tl.zeros((ROWS, FEATURES), dtype=tl.float32)
    for kb in range(0, k_blocks):
        weights = values(blocks, (n.to(tl.int64) * k_blocks + kb) * type_size, n_mask, QTYPE)
        inputs = tl.load(x + r[:, None] * in_features + kb * VALUES + j[None, :], mask=r_mask[:, None], other=0.0)
        total += tl.sum(inputs.to(tl.float32)[:, None, :] * weights[None, :, :], axis=2)
    tl.store(out + r[:, None] * out_features + n[None, :], total, mask=r_mask[:, None] & n_mask[None, :])
