"""Raw GGML blocks for the quant tests and the dequant benchmark: random bits with finite float16 scales, or with
the special values (NaN payloads, infinities, subnormals) planted where each type keeps its scales."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
FLOATS = (Q.F32, Q.F16, Q.BF16)
# Byte offsets of the float16 d / dmin / m fields inside one block (ggml-common.h). MXFP4 and NVFP4 scales are
# 8-bit floats without NaN; IQ1_M keeps d's bits in the top nibbles of its last four u16 (see `write_iq1_m_scales`).
SCALE_OFFSETS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ1_S: (0,), Q.IQ1_M: (), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.MXFP4: (), Q.NVFP4: (),
}
# float16 scales every random-bytes test plants: quiet and signalling NaNs with payloads, both infinities,
# subnormals, negative zero, the largest finite.
SPECIAL_HALVES = np.array([0x7E01, 0xFE00, 0x7D55, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x8000, 0x7BFF], dtype=np.uint16)

def write_iq1_m_scales(raw: np.ndarray, scales: np.ndarray) -> None:
    """Write float16 `scales` into the top nibbles of each IQ1_M block's last four u16, lowest nibble first."""
    words = raw[:, 48:56].copy().view(np.uint16)
    bits = scales.view(np.uint16)[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)
    raw[:, 48:56] = ((words & 0x0FFF) | ((bits & 0xF) << 12)).view(np.uint8)


def random_bytes(qtype: Q, shape: tuple[int, int], seed: int = 0, finite: bool = True) -> np.ndarray:
    """Raw blocks of `shape`, one row per tensor row: random bits, with finite float scales unless not `finite`
    (then the first blocks' float16 scales are SPECIAL_HALVES)."""
    rng = np.random.default_rng(seed)
    if qtype in FLOATS and finite:
        return gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), qtype).view(np.uint8)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if not finite:
        planted = min(n_blocks, len(SPECIAL_HALVES))
        for shift, offset in enumerate(SCALE_OFFSETS.get(qtype, ())):  # shifted: d and m NaN with other payloads
            raw[:planted, offset : offset + 2] = np.roll(SPECIAL_HALVES, shift)[:planted, None].view(np.uint8)
        if qtype == Q.IQ1_M:
            write_iq1_m_scales(raw[:planted], SPECIAL_HALVES[:planted].view(np.float16))
        return raw.reshape(shape[0], -1)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-2, 2, n_blocks).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.IQ1_M:
        write_iq1_m_scales(raw, rng.uniform(-2, 2, n_blocks).astype(np.float16))
    return raw.reshape(shape[0], -1)


def as_on_a_gpu(monkeypatch, tables_as_a_devices: bool = False) -> None:
    """The torch kernels on this CPU as they run off it: the reference design, no fused CPU kernel; with
    `tables_as_a_devices`, every lookup table read as a device's copy (made once, outside any graph)."""
    from streamwise.runtime.quant import gguf_dequant, gguf_tables

    monkeypatch.setattr(gguf_dequant, "torch_fields", lambda device: gguf_dequant.FIELDS)
    monkeypatch.setattr(gguf_dequant, "_fused_cpu", lambda qtype, blocks: None)
    if tables_as_a_devices:
        monkeypatch.setattr(gguf_tables, "table", gguf_tables.device_table)
