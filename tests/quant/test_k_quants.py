"""K-quant blocks bit for bit what llama.cpp's reference quantizers make (`tests/fixtures/k_quants/reference.npz`,
made by `make_reference.py` through a `libggml-base` built from llama.cpp's source), and what they read back as."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from streamwise.runtime.quant import k_quants
from streamwise.runtime.quant.gguf_dequant import dequantize

REFERENCE = np.load(Path(__file__).resolve().parents[1] / "fixtures" / "k_quants" / "reference.npz")
CASES = sorted({key.split("/")[0] for key in REFERENCE.files})
TYPES = [gguf.GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K")]
ERROR = {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}  # relative to a normal tensor's norm, about twice what it is


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES)
def test_blocks_equal_llama_cpps_reference_quantizer(case, qtype):
    blocks = k_quants.quantize(REFERENCE[f"{case}/input"], qtype)
    expected = REFERENCE[f"{case}/{qtype.name}"]
    assert blocks.shape == expected.shape
    differing = np.nonzero((blocks != expected).any(axis=1))[0]
    assert differing.size == 0, f"rows {differing.tolist()} differ"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_read_back_within_the_types_error(qtype):
    x = REFERENCE["normal/input"]
    blocks = torch.from_numpy(k_quants.quantize(x, qtype).reshape(-1).copy())
    values = dequantize(blocks, qtype, x.shape).numpy()
    assert np.linalg.norm(values - x) / np.linalg.norm(x) < ERROR[qtype.name]


def test_rows_that_fill_no_whole_block_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        k_quants.quantize(np.zeros((2, 128), np.float32), gguf.GGMLQuantizationType.Q4_K)
