"""The dequant cache: a resident a forward calls again is expanded once, and the cache holds nothing for a model
called layer after layer; a changed storage, dtype or a collected module is never served stale."""

from __future__ import annotations

import gc

import gguf
import pytest
import torch
from gguf_blocks import random_bytes
from torch import nn

import streamwise
from streamwise.runtime.quant import dequant_cache, formats
from streamwise.runtime.quant.dequant_cache import DequantCache

from helpers import make_policy

Q = gguf.GGMLQuantizationType
POLICY = make_policy(quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "gguf"}]})
WIDTH = 256
WEIGHT_BYTES = WIDTH * WIDTH * 4  # one dequantized float32 weight


class Looped(nn.Module):
    """ALBERT's shape: one layer applied at every depth."""

    def __init__(self, layers: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return x


def looped_from_file(tmp_path, layers: int, depth: int, **load) -> Looped:
    """Residents in the float32 arithmetic: the route that expands (the int8 one reads blocks, with no cache)."""
    path = tmp_path / "looped.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    for index in range(layers):
        raw = random_bytes(Q.Q8_0, (WIDTH, WIDTH), seed=index, finite=True)
        writer.add_tensor(f"layers.{index}.weight", raw, raw_dtype=Q.Q8_0)
        writer.add_tensor(f"layers.{index}.bias", torch.zeros(WIDTH).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with streamwise.skeleton():
        model = Looped(layers, depth)
    report = streamwise.load(model, path, POLICY, progress=False, arithmetic="float32", **load)
    assert report.residents == {"gguf": layers} and report.cpu_arithmetic == {"Q8_0": "float32"}
    return model


@pytest.fixture
def cache(monkeypatch) -> DequantCache:
    """A cache of its own (bound: three weights), and a count of expansions."""
    cache = DequantCache(3 * WEIGHT_BYTES)
    monkeypatch.setattr(dequant_cache, "DEQUANT_CACHE", cache)
    handler = formats.FORMATS["gguf"]
    cache.expansions = 0
    expand = handler.dequantize

    def counted(*args, **kwargs):
        cache.expansions += 1
        return expand(*args, **kwargs)

    monkeypatch.setattr(handler, "dequantize", counted)
    return cache


def test_a_layer_a_forward_calls_again_is_expanded_once_and_computes_the_same(tmp_path, cache):
    model = looped_from_file(tmp_path, layers=2, depth=6)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        outputs = [model(x) for _ in range(3)]  # 36 calls of 2 residents
    assert cache.expansions == 4  # each: asked once (remembered), asked again (admitted), then served
    assert cache.held == 2 * WEIGHT_BYTES
    cache.bound = 0  # off: every call expands
    with torch.inference_mode():
        expected = model(x)
    assert cache.expansions == 4 + 12
    assert all(torch.equal(output, expected) for output in outputs)


def test_a_model_called_layer_after_layer_beyond_the_bound_holds_nothing(tmp_path, cache):
    model = looped_from_file(tmp_path, layers=5, depth=1)  # reuse distance: five weights, the bound three
    x = torch.randn(3, WIDTH)
    with torch.inference_mode():
        for _ in range(4):
            model(x)
    assert cache.expansions == 20 and cache.held == 0


def test_a_written_storage_a_new_dtype_or_a_collected_module_is_never_served_stale(tmp_path, cache):
    model = looped_from_file(tmp_path, layers=1, depth=3)
    x = torch.randn(3, WIDTH)
    with torch.inference_mode():
        model(x)
    assert cache.held == WEIGHT_BYTES
    stored = model.layers[0]._parameters["weight"]
    replacement = torch.from_numpy(random_bytes(Q.Q8_0, (WIDTH, WIDTH), seed=9, finite=True)).view(-1)
    with torch.no_grad():
        stored.copy_(replacement.view(stored.shape))  # a write in place: its version moves on
    weight = streamwise.runtime.quant.gguf_dequant.dequantize(replacement, Q.Q8_0, (WIDTH, WIDTH))
    bias = model.layers[0].bias.detach()
    with torch.inference_mode():
        assert torch.equal(model.layers[0](x), nn.functional.linear(x, weight, bias))
        wide = model.layers[0](x.double())  # another dtype: its own expansion, in float64
    assert wide.dtype == torch.float64
    assert torch.allclose(wide, nn.functional.linear(x.double(), weight.double(), bias.double()), rtol=1e-9, atol=1e-9)
    del model, stored
    gc.collect()
    other = looped_from_file(tmp_path, layers=1, depth=1)
    with torch.inference_mode():
        other(x)  # the next ask drops what a collected module left
    assert cache.held == 0


def test_a_load_under_a_host_budget_lowers_the_bound_to_what_the_budget_leaves(tmp_path, cache):
    expanding = 2 * WEIGHT_BYTES  # kept free for a forward to expand the weight at a call (`expansion_bytes`)
    budget = expanding + (200 << 10)
    looped_from_file(tmp_path, layers=1, depth=1, max_memory={"cpu": budget})
    # what the one Q8_0 weight (256 rows of 8 blocks) and its expansion leave
    assert 0 < cache.bound <= budget - expanding - 256 * 34 * 8


def test_storage_loaded_under_inference_mode_keeps_no_version_and_is_still_cached(tmp_path, cache):
    with torch.inference_mode():  # ComfyUI loads under it: the stored tensors are inference tensors
        model = looped_from_file(tmp_path, layers=1, depth=3)
        model(torch.randn(3, WIDTH))
    assert cache.expansions == 2 and cache.held == WEIGHT_BYTES
