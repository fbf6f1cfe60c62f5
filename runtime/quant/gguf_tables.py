"""Lookup tables the torch kernels read, made from the gguf package (grids, sign patterns, value tables) and numpy's
half widening, built once at import on the CPU and copied to a device once.

A per-element gather is slow on a CPU, so each table answers several values per index: a grid row with its signs
applied, or the values of two nibbles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf.quants as reference
import numpy as np
import torch
from torch import Tensor


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
#: Read by the CPU's design only (`gguf_cpu_fields`): numpy's widening of every half, the lookups by word, Q5's
#: top bits by byte.
CPU_ONLY = {"f16", "q5_high0", "q5_high-16", *(f"{name}_words" for name in _NIBBLE_VALUES)}
#: Built at import (about 8 MB, a few ms): a compiled graph reads a module's tensor as a constant.
CPU_TABLES = {name: torch.from_numpy(np.ascontiguousarray(source())) for name, source in _TABLE_SOURCES.items()}
_DEVICE_TABLES: dict[tuple[str, torch.device], Tensor] = {}


def prepare(device: torch.device) -> None:
    """Every table the reference design reads, copied to `device` once (a few MB; on the CPU nothing is copied): a
    graph compiled there afterwards reads them as inputs, where one copied while it is traced would break it."""
    for name in CPU_TABLES.keys() - CPU_ONLY:
        device_table(name, device)


def table(name: str, device: torch.device) -> Tensor:
    """Table `name` on `device`."""
    return CPU_TABLES[name] if device.type == "cpu" else device_table(name, device)


def device_table(name: str, device: torch.device) -> Tensor:
    """Table `name` on `device`, copied there once. A compiled graph reads one copied before it was traced as an
    input; one not copied yet is copied outside the graph: a break, which that graph keeps."""
    if (name, device) in _DEVICE_TABLES:
        return _DEVICE_TABLES[name, device]
    return _copied_table(name, device)


@torch.compiler.disable
def _copied_table(name: str, device: torch.device) -> Tensor:
    copied = _DEVICE_TABLES[name, device] = CPU_TABLES[name].to(device)
    return copied


def lookup(name: str, index: Tensor, out: Tensor) -> None:
    """Fill `out` with the rows of table `name` that `index` picks, in index order, gathered straight into it."""
    rows = table(name, out.device)
    torch.index_select(rows, 0, index.reshape(-1), out=out.view(-1, rows.shape[-1]))
