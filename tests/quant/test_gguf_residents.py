"""GGUF residents of the types added for every-gguf-type support: loaded from a file, they keep the raw blocks,
stream them as bytes, and compute what the reference's dequantized float weight computes, LoRA included."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import random_bytes
from torch import nn

import streamwise

from helpers import force_streaming, make_policy

Q = gguf.GGMLQuantizationType
POLICY = make_policy(stream={"rule": [{"id": "l", "kind": "linear", "select": {"class": "Linear"}}]},
                     quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "gguf"}]})
OUT_FEATURES, IN_FEATURES = 8, 256


def identical(result: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal values, NaN where the reference has NaN (random MXFP4 exponents reach Inf weights)."""
    return torch.allclose(result, expected, rtol=0, atol=0, equal_nan=True)


def resident_from_file(tmp_path, qtype: Q) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A one-Linear model loaded from a GGUF holding random `qtype` blocks; also the reference's float weight."""
    raw = random_bytes(qtype, (OUT_FEATURES, IN_FEATURES), seed=5)
    bias = np.random.default_rng(6).standard_normal(OUT_FEATURES, dtype=np.float32)
    path = tmp_path / "resident.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_tensor("proj.weight", raw, raw_dtype=qtype)
    writer.add_tensor("proj.bias", bias)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with streamwise.skeleton():
        model = nn.Sequential()
        model.add_module("proj", nn.Linear(IN_FEATURES, OUT_FEATURES))
    assert streamwise.load(model, path, POLICY).residents == {"gguf": 1}
    return model, torch.from_numpy(gguf.quants.dequantize(raw, qtype)), torch.from_numpy(raw)


@pytest.mark.parametrize("qtype", [Q.IQ4_XS, Q.TQ2_0, Q.IQ1_M, Q.IQ3_S, Q.MXFP4, Q.NVFP4], ids=lambda t: t.name)
def test_a_resident_streams_its_raw_blocks_and_computes_with_the_reference_weight(tmp_path, qtype):
    model, weight, raw = resident_from_file(tmp_path, qtype)
    layer = model.proj
    stored = layer._parameters["weight"]
    assert stored.dtype == torch.uint8 and torch.equal(stored.reshape(raw.shape), raw)
    x = torch.randn(3, IN_FEATURES, generator=torch.Generator().manual_seed(7))
    expected = nn.functional.linear(x, weight, layer.bias)
    assert identical(model(x), expected)

    fetched = []
    fetcher = streamwise.runtime.convert.applied_state(model).tree.fetcher
    original_fetch = fetcher.fetch_raw

    def fetch_raw(module, names, device):
        fetched.extend(module._parameters[name].dtype for name in names if module._parameters.get(name) is not None)
        return original_fetch(module, names, device)

    fetcher.fetch_raw = fetch_raw
    force_streaming(model)
    assert identical(model(x), expected)
    assert fetched[0] == torch.uint8  # the blocks travel as bytes, never cast


@pytest.mark.parametrize("qtype", [Q.IQ4_XS, Q.TQ2_0], ids=lambda t: t.name)
def test_a_lora_weight_function_applies_to_the_dequantized_weight(tmp_path, qtype):
    model, weight, _ = resident_from_file(tmp_path, qtype)
    layer = model.proj
    delta = torch.randn_like(weight) * 0.01
    layer.weight_function = [lambda w: w + delta]
    x = torch.randn(3, IN_FEATURES, generator=torch.Generator().manual_seed(7))
    assert torch.equal(layer(x), nn.functional.linear(x, weight + delta, layer.bias))
