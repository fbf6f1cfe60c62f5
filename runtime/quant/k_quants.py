"""GGML's K-quants written as llama.cpp writes them: Q4_K, Q5_K and Q6_K blocks bit for bit what ggml's reference
quantizers make (`quantize_row_q4_K_ref`, `..._q5_K_ref`, `..._q6_K_ref` in `ggml/src/ggml-quants.c` at llama.cpp
0c1e5709, the commit `llama-cpp-python` 0.3.36 vendors), which is what `llama-quantize` runs without an importance
matrix. The gguf package quantizes none of them.

The C code works one 32- or 16-value sub-block at a time; here every sub-block of a tensor is worked at once, each
step on whole arrays (one column per sub-block, so that each of the C's sums is a run of vector adds).
Bit-exactness rests on three things kept from the C: every value is float32 (no float64 intermediate), each sum
runs in the C's order (`_sequential_sum`, never numpy's pairwise `sum`), and rounding is ggml's `nearest_int` (to
nearest, ties to even: `np.rint`).
"""

from __future__ import annotations

import gguf
import numpy as np

from .errors import QuantError

QK_K = 256
F32 = np.float32
_EPS = F32(1e-15)  # GROUP_MAX_EPS


def _sequential_sum(values: np.ndarray) -> np.ndarray:
    """`s = v[0]; s += v[1]; ...` along the first axis (a sub-block's values, one column per sub-block), in
    float32, as the C loops add: one vector add per value, across every sub-block at once."""
    total = values[0].copy()
    for row in values[1:]:
        total += row
    return total


def _nearest(values: np.ndarray) -> np.ndarray:
    return np.rint(values).astype(np.int32)


def _fp16(values: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 and back: the float32 a stored half reads as."""
    return values.astype(np.float16)


def _min_scale_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """`make_qkx2_quants` on every column of `x` (sub-blocks of 32): levels in 0..nmax (as float32), the scale and
    the (negated) minimum that fit them best by weighted squared error over `nstep + 1` trial scales."""
    low = x.min(axis=0)
    low = np.where(low > 0, F32(0), low)  # `if (min > 0) min = 0`, keeping a -0.0 as the C does
    high = x.max(axis=0)
    flat = high == low
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(nmax) / np.where(flat, F32(1), high - low)
        scale = F32(1) / iscale
        levels = np.clip(np.rint(iscale * (x - low)), 0, nmax)
        diff = scale * levels + low - x
        best = _sequential_sum(weights * (diff * diff))
        minimum = low.copy()
        for step in range(nstep + 1):  # from the minimum found so far, as the C's `min` is updated in place
            trial = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / np.where(flat, F32(1), high - minimum)
            trial_levels = np.clip(np.rint(trial * (x - minimum)), 0, nmax)
            wl = weights * trial_levels
            sum_l, sum_l2, sum_xl = _sequential_sum(wl), _sequential_sum(wl * trial_levels), _sequential_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, F32(0), this_min)
            diff = this_scale * trial_levels + this_min - x
            error = _sequential_sum(weights * (diff * diff))
            better = (det > 0) & (error < best) & ~flat
            levels = np.where(better, trial_levels, levels)
            best = np.where(better, error, best)
            scale = np.where(better, this_scale, scale)
            minimum = np.where(better, this_min, minimum)
    levels = np.where(flat, F32(0), levels)
    scale = np.where(flat, F32(0), scale)
    return levels, scale.astype(F32), (-minimum).astype(F32)


def _packed_scales_and_mins(scales: np.ndarray, mins: np.ndarray):
    """The 6-bit scales and mins of a Q4_K/Q5_K super-block (8 per block), packed into 12 bytes as ggml packs them,
    with the block's `d` and `dmin` (float16) and the 6-bit values themselves."""
    max_scale = np.where(scales > 0, scales, F32(0)).max(axis=-1)  # from +0.0, raised by larger values only
    max_min = np.where(mins > 0, mins, F32(0)).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(_nearest(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # `uint8_t ls = ...`
    lm = np.minimum(_nearest(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.zeros((scales.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return packed, _fp16(max_scale / F32(63)), _fp16(max_min / F32(63)), ls, lm


def _min_scale_blocks(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """What Q4_K and Q5_K share: per 32-value sub-block levels in 0..nmax, then the super-block's packed scales."""
    blocks = x.reshape(-1, QK_K)
    sub = np.ascontiguousarray(blocks.reshape(-1, 32).T)  # one column per sub-block
    average = np.sqrt(_sequential_sum(sub * sub) / F32(32))
    weights = average + np.abs(sub)
    levels, scales, mins = _min_scale_quants(sub, weights, nmax, rmin, 0.1, nstep)
    levels = levels.T
    packed, d, dmin, ls, lm = _packed_scales_and_mins(scales.reshape(-1, 8), mins.reshape(-1, 8))
    step = d.astype(F32)[:, None] * ls.astype(F32)
    offset = dmin.astype(F32)[:, None] * lm.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        final = np.clip(_nearest((blocks.reshape(-1, 8, 32) + offset[..., None]) / step[..., None]), 0, nmax)
    levels = np.where((step != 0)[..., None], final, levels.reshape(-1, 8, 32).astype(np.int32))
    levels = levels.astype(np.uint8).reshape(-1, QK_K)
    return levels, packed, d, dmin


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    levels, packed, d, dmin = _min_scale_blocks(x, 15, -1.0, 20)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return _rows(x, [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs])


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    levels, packed, d, dmin = _min_scale_blocks(x, 31, -0.5, 15)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    high = (pairs >> 4).astype(np.uint8)  # bit 4 of each level: chunk n's pair sets bits 2n and 2n + 1 of qh
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    qh = np.bitwise_or.reduce((high << shifts[None, :, :, None]).reshape(-1, 8, 32), axis=1)
    return _rows(x, [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qh, qs])


def _symmetric_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """`make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)` on every column of `x`: levels in 0..2 nmax - 1 and the
    scale, weighted by x², searched over 18 trial scales around nmax / max."""
    first = np.argmax(np.abs(x), axis=0)
    peak = np.take_along_axis(x, first[None, :], axis=0)[0]  # the first value of the largest magnitude
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, F32(1), peak)
    weights = x * x

    def trial(iscale):
        levels = np.clip(np.rint(iscale * x), -nmax, nmax - 1)
        return levels, _sequential_sum(weights * x * levels), _sequential_sum(weights * levels * levels)

    levels, sumlx, suml2 = trial(F32(-nmax) / peak)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            candidate, sumlx, suml2 = trial(-(F32(nmax) + F32(0.1) * F32(step)) / peak)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            levels = np.where(better, candidate, levels)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    levels = np.where(zero, F32(-nmax), levels) + F32(nmax)
    return levels.astype(np.int32), np.where(zero, F32(0), scale).astype(F32)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK_K)
    levels, scales = _symmetric_quants(np.ascontiguousarray(blocks.reshape(-1, 16).T), 32)
    levels = levels.T
    scales = scales.reshape(-1, 16)
    first = np.argmax(np.abs(scales), axis=-1)
    max_scale = np.take_along_axis(scales, first[:, None], axis=-1)[:, 0]
    empty = np.abs(max_scale) < _EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / np.where(empty, F32(1), max_scale)
        d = _fp16(F32(1) / iscale)
        block_scales = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
        step = d.astype(F32)[:, None] * block_scales.astype(F32)
        final = np.clip(_nearest(blocks.reshape(-1, 16, 16) / step[..., None]), -32, 31) + 32
    levels = np.where((step != 0)[..., None], final, levels.reshape(-1, 16, 16)).reshape(-1, 2, 4, 32)
    low, high = (levels & 0xF).astype(np.uint8), (levels >> 4).astype(np.uint8)
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), block_scales.view(np.uint8), d.view(np.uint8).reshape(-1, 2)]
    out = np.concatenate(parts, axis=-1)
    out[empty] = 0  # memset, d = +0.0
    return out.reshape(*x.shape[:-1], -1)


def _rows(x: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
    """The blocks' byte fields side by side, one row of blocks per row of `x`."""
    return np.concatenate(parts, axis=-1).reshape(*x.shape[:-1], -1)


QUANTIZERS = {
    gguf.GGMLQuantizationType.Q4_K: quantize_q4_k,
    gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
    gguf.GGMLQuantizationType.Q6_K: quantize_q6_k,
}


_CHUNK = 2**18
"""Values quantized at a time: the trial arrays of 256 k values stay in cache (2.6x faster than a 4 M-value tensor
at once)."""


def quantize(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`values` (rows of whole 256-value blocks) as `qtype`'s blocks, bit for bit ggml's reference quantizer."""
    x = np.ascontiguousarray(values, dtype=F32)
    if x.shape[-1] % QK_K:
        raise QuantError(f"{qtype.name} rows hold whole blocks of {QK_K} values, not {x.shape[-1]}")
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, _CHUNK // rows.shape[1])
    blocks = [QUANTIZERS[qtype](rows[start:start + step]) for start in range(0, rows.shape[0], step)]
    return np.concatenate(blocks).reshape(*x.shape[:-1], -1)
