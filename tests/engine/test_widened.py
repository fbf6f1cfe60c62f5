"""Half-precision Linear layers a load fills multiply several rows in float32 on the CPU (`engine.widened`): the
values of float32 arithmetic on the same halves, one rounding; a single row, tracers and gradients keep torch's own
kernel; trees converted in place are untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import streamwise
from streamwise.runtime.engine import protocol, widened

from helpers import tiny_qwen2

HALVES = [torch.float16, torch.bfloat16]
WIDENED = [pytest.param(dtype, id=name.lower(), marks=pytest.mark.skipif(
    dtype not in widened._WIDENED, reason=f"this CPU multiplies {name} natively: torch's kernel is the fast one"))
    for dtype, name in widened.HALF_TYPES.items()]
"""Each half type, where this CPU widens it."""


def _ulps_apart(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between two tensors' elements (both finite)."""
    return (got.view(torch.int16).int() - expected.view(torch.int16).int()).abs()  # same signs here: no zeros near


def _float32_arithmetic(x, weight, bias):
    """The layer computed in float32 on the same half values, rounded once into their dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", WIDENED)
@pytest.mark.parametrize("slab_bytes", [widened.SLAB_BYTES, 3 * 4 * 96], ids=["one-slab", "ragged-slabs"])
def test_several_rows_take_float32_arithmetic(monkeypatch, dtype, slab_bytes):
    monkeypatch.setattr(widened, "SLAB_BYTES", slab_bytes)  # 3 rows of 96 a slab: 70 weight rows in 24 slabs
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 96, generator=generator).to(dtype)
    bias = torch.randn(70, generator=generator).to(dtype)
    x = torch.randn(2, 5, 96, generator=generator).to(dtype)
    assert widened.widens(x, weight)
    assert widened.widens(x[0, : widened.ROWS], weight) and not widened.widens(x[0, : widened.ROWS - 1], weight)

    got = widened.linear(x, weight, bias)

    expected = _float32_arithmetic(x, weight, bias)
    assert got.shape == (2, 5, 70) and got.dtype == dtype and got.is_contiguous()
    apart = _ulps_apart(got, expected)  # float32 sums in another order: at most the last bit of the rounding
    assert apart.max() <= 1 and (apart == 0).float().mean() > 0.95
    exact = (x.double() @ weight.double().T + bias.double()).float()
    error = (got.float() - exact).norm() / exact.norm()
    assert error <= 2 * (torch.finfo(dtype).eps / 2)  # the output's rounding, nothing more


@pytest.mark.parametrize("dtype", HALVES, ids=["fp16", "bf16"])
def test_one_row_a_float32_weight_and_tracers_keep_torch_s_kernel(dtype):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 64, generator=generator).to(dtype)
    one_row = torch.randn(1, 3, 64, generator=generator).to(dtype)  # three rows: fewer than `ROWS`
    assert not widened.widens(one_row, weight)
    assert torch.equal(widened.linear(one_row, weight, None), F.linear(one_row, weight))

    rows = torch.randn(8, 64, generator=generator)
    assert not widened.widens(rows, weight.float())  # float32 weights: nothing to widen
    assert not widened.widens(rows, weight)  # float32 activations against a half weight: torch's own error

    asking = rows.to(dtype).requires_grad_()
    assert not widened.widens(asking, weight)  # a gradient is asked: autograd sees F.linear
    out = widened.linear(asking, weight, None)
    assert torch.equal(out, F.linear(asking, weight))
    out.float().sum().backward()
    assert asking.grad is not None
    trained = torch.nn.Parameter(weight.clone())
    assert not widened.widens(rows.to(dtype), trained)  # a weight's gradient asked (a parameter, grad mode on)
    with torch.no_grad():
        assert widened.widens(rows.to(dtype), trained) == (dtype in widened._WIDENED)

    def traced(x):
        return widened.linear(x, weight, None)

    explained = torch._dynamo.explain(traced)(rows.to(dtype))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_native_half_kernels_are_left_to_torch(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False, raising=False)
    assert widened._native(torch.bfloat16) and not widened._native(torch.float16)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert not widened._native(torch.bfloat16)  # an older torch without the probes: widened


@pytest.mark.parametrize("dtype", WIDENED)
def test_a_loaded_half_model_widens_and_one_converted_in_place_does_not(tmp_path, dtype):
    torch.manual_seed(0)
    original = tiny_qwen2().to(dtype)
    original.save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 12))

    loaded, report, _ = streamwise.load_pretrained(tmp_path, "auto", progress=False)

    name = widened.HALF_TYPES[dtype]
    assert report.cpu_arithmetic == {name: "float32"} and f"on the CPU {name} in float32" in str(report)
    up = loaded.model.layers[0].mlp.up_proj
    assert up.__dict__[protocol.ARITHMETIC] == widened.ARITHMETIC
    seen = []
    layer_input = torch.randn(1, 12, 64).to(dtype)
    hook = up.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        up(layer_input)
        logits = loaded(ids).logits
    hook.remove()
    x, out = seen[0]
    with torch.no_grad():
        assert widened.widens(x, up.weight) and torch.equal(out, widened.linear(x, up.weight, None))
    with torch.no_grad():
        expected = original(ids).logits
    relative = (logits.float() - expected.float()).norm() / expected.float().norm()
    assert relative < 20 * torch.finfo(dtype).eps  # last-bit differences, carried through two layers

    converted = copy.deepcopy(original)
    streamwise.apply_policy(converted, "auto")  # converted in place: its original's bits
    assert protocol.ARITHMETIC not in converted.model.layers[0].mlp.up_proj.__dict__
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, expected)


@pytest.mark.skipif(torch.float16 not in widened._WIDENED, reason="this CPU multiplies F16 natively")
def test_a_loaded_half_model_streamed_at_budget_0_computes_what_it_computes_resident(tmp_path):
    """Fetched weights widen as resident ones do: budget 0 and everything resident give the same numbers."""
    torch.manual_seed(0)
    tiny_qwen2().to(torch.float16).save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 12))
    resident, _, _ = streamwise.load_pretrained(tmp_path, "auto", progress=False)
    streamed, _, _ = streamwise.load_pretrained(tmp_path, "auto", progress=False)
    report = streamwise.offload(streamed, "decoder-llm", device="cpu", budget=0)
    assert report.resident_modules == 0 and report.streamed_modules > 0
    assert streamed.model.layers[0].mlp.up_proj.__dict__[protocol.ARITHMETIC] == widened.ARITHMETIC
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits, resident(ids).logits)
