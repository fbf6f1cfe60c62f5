"""The torch GGML dequantizers against gguf's numpy reference: bit-exact float32 on every supported type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from streamwise.runtime.quant.gguf_dequant import DEQUANTIZERS, STORED_FLOATS, UnsupportedQuantType, dequantize

Q = gguf.GGMLQuantizationType
FLOATS = (Q.F32, Q.F16, Q.BF16)
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)  # gguf.quants.quantize supports these
# Byte offsets of the float16 d / dmin / m fields inside one block (ggml-common.h).
SCALE_OFFSETS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
SHAPES = [(4, 256), (3, 512)]
SUPPORTED = [*FLOATS, *SCALE_OFFSETS]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_bytes(qtype: Q, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Raw blocks of `shape`, one row per tensor row: random quant bits, finite float scales."""
    rng = np.random.default_rng(seed)
    if qtype in FLOATS:
        return gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), qtype).view(np.uint8)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-2, 2, n_blocks).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(shape[0], -1)


def reference(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    expected = gguf.quants.dequantize(raw, qtype)
    assert not np.isnan(expected).any()
    return torch.from_numpy(np.ascontiguousarray(expected))


def test_registry_covers_exactly_the_supported_types():
    assert set(STORED_FLOATS) == set(FLOATS)
    assert set(DEQUANTIZERS) == set(SCALE_OFFSETS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_random_blocks_match_reference_bit_exactly(qtype, shape):
    raw = random_bytes(qtype, shape)
    result = dequantize(torch.from_numpy(raw), qtype, shape)
    assert result.dtype == torch.float32 and result.shape == shape
    assert torch.equal(result, reference(raw, qtype))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_data_matches_reference_bit_exactly(qtype):
    data = np.random.default_rng(1).standard_normal((4, 256), dtype=np.float32)
    raw = gguf.quants.quantize(data, qtype)
    assert torch.equal(dequantize(torch.from_numpy(raw), qtype, data.shape), reference(raw, qtype))


def test_flat_blocks_give_the_same_values():
    raw = random_bytes(Q.Q4_K, (3, 512))
    flat = torch.from_numpy(raw).reshape(-1)
    assert torch.equal(dequantize(flat, Q.Q4_K, (3, 512)), dequantize(torch.from_numpy(raw), Q.Q4_K, (3, 512)))


@pytest.mark.parametrize("n_blocks", [1, 3], ids=lambda n: f"{n}-blocks")
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_blocks_at_an_odd_offset_or_stride_give_the_same_values(qtype, n_blocks):
    """Bytes sliced out of a larger buffer (a file map, a packed record): no alignment is promised."""
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    shape = (n_blocks, block_size)
    raw = random_bytes(qtype, shape)
    expected = reference(raw, qtype)
    flat = torch.from_numpy(raw.copy()).reshape(-1)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]
    strided = torch.stack([flat, torch.zeros_like(flat)], dim=1).reshape(-1)[::2]
    assert shifted.storage_offset() == 1 and strided.stride() == (2,)
    assert torch.equal(dequantize(shifted, qtype, shape), expected)
    assert torch.equal(dequantize(strided, qtype, shape), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.BF16], ids=lambda t: t.name)
def test_output_dtype_is_the_float32_result_cast(qtype, dtype):
    blocks = torch.from_numpy(random_bytes(qtype, (4, 256)))
    result = dequantize(blocks, qtype, (4, 256), dtype=dtype)
    assert result.dtype == dtype
    assert torch.equal(result, dequantize(blocks, qtype, (4, 256)).to(dtype))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q8_K, Q.TQ2_0], ids=lambda t: t.name)
def test_unsupported_type_is_named(qtype):
    with pytest.raises(UnsupportedQuantType, match=qtype.name) as error:
        dequantize(torch.zeros(1024, dtype=torch.uint8), qtype, (4, 256))
    assert isinstance(error.value, ValueError)
    assert "Q4_K" in str(error.value) and "BF16" in str(error.value)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_empty_tensor_gives_an_empty_result(qtype):
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    result = dequantize(torch.zeros(0, dtype=torch.uint8), qtype, (0, block_size), dtype=torch.bfloat16)
    assert result.shape == (0, block_size) and result.dtype == torch.bfloat16


def test_wrong_byte_count_is_rejected():
    raw = torch.from_numpy(random_bytes(Q.Q8_0, (4, 256)))
    with pytest.raises(ValueError, match="needs 1088 bytes, got 1054"):
        dequantize(raw.reshape(-1)[:-34], Q.Q8_0, (4, 256))


def test_rows_must_hold_whole_blocks():
    with pytest.raises(ValueError, match="blocks of 256"):
        dequantize(torch.zeros(144 * 2, dtype=torch.uint8), Q.Q4_K, (4, 128))


def test_blocks_must_be_bytes():
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(256, dtype=torch.int8), Q.Q8_0, (8, 32))


@CUDA
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_cuda_matches_reference_bit_exactly(qtype):
    raw = random_bytes(qtype, (3, 512), seed=2)
    result = dequantize(torch.from_numpy(raw).cuda(), qtype, (3, 512))
    assert result.is_cuda
    assert torch.equal(result.cpu(), reference(raw, qtype))
