"""The CPU matmuls that read GGUF blocks in place (llama.cpp's arithmetic): each type's kernel computes exactly
`quantized activations · dequantized weight`, within the int8 bound of dequantize → `F.linear` in float32, non-finite
where float arithmetic is, the same bits on any number of threads and by either vector route; GGUF residents take it
on the CPU (no expansion, none counted in the budget, a compiled graph without breaks), and `arithmetic="float32"`
keeps the expanding route, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import random_bytes
from torch import nn

import streamwise
from streamwise.runtime.quant import formats
from streamwise.runtime.quant.gguf_dequant import dequantize

from helpers import make_policy

gguf_matmul_cpu = pytest.importorskip("streamwise.runtime.quant.gguf_matmul_cpu", reason="numba is not installed")

Q = gguf.GGMLQuantizationType
TYPES = sorted(gguf_matmul_cpu.TYPES, key=lambda t: t.name)
OUT, IN = 48, 512  # two K-quant blocks, sixteen Q8_0 blocks per row
INT8_BOUND = 1e-2
"""The int8 arithmetic's stated bound against dequantize → F.linear in float32 (relative L2, random data)."""


def relative_l2(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.double() - reference.double()).norm() / reference.double().norm()).item()


def blocks_and_weight(qtype: Q, seed: int = 0, finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.from_numpy(random_bytes(qtype, (OUT, IN), seed=seed, finite=finite)).reshape(-1)
    return raw, dequantize(raw, qtype, (OUT, IN), torch.float32)


def activations(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed))


def rounded(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    """The activations as the kernels multiply them: their int8 values times their group's scale."""
    group = gguf.GGML_QUANT_SIZES[qtype][0]
    values, scales, _ = gguf_matmul_cpu.quantize_activations(x, group)
    return (values.double().reshape(len(x), -1, group) * scales.double()[..., None]).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 5, 32], ids=lambda r: f"{r}rows")  # one row; four together and one; many
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_kernel_computes_the_rounded_activations_times_the_weight_within_the_int8_bound(qtype, rows):
    blocks, weight = blocks_and_weight(qtype)
    x = activations(rows)
    result = gguf_matmul_cpu.matmul(x, blocks, qtype, OUT)
    assert result.shape == (rows, OUT) and result.dtype == torch.float32
    # exactly the arithmetic it claims: only the activations' rounding differs from float32 (summation order aside)
    assert relative_l2(result, rounded(x, qtype) @ weight.double().T) < 1e-6
    assert relative_l2(result, nn.functional.linear(x, weight)) < INT8_BOUND


@pytest.mark.parametrize("group", [32, 256])
def test_activations_round_to_nearest_with_the_largest_magnitude_at_127(group):
    x = activations(3) * torch.logspace(-3, 3, IN)  # groups of very different sizes
    x[1, :group] = 0  # an all-zero group: scale 0, values 0
    values, scales, sums = gguf_matmul_cpu.quantize_activations(x, group)
    grouped, scale = values.reshape(3, -1, group), scales[..., None]
    assert torch.all((x.reshape(3, -1, group) - grouped * scale).abs() <= scale / 2 * (1 + 1e-6))
    assert torch.all(grouped.abs().amax(dim=-1) == torch.where(scales > 0, 127, 0))
    assert torch.equal(sums, values.reshape(3, -1, 32).sum(dim=-1).float())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_non_finite_scales_and_activations_reach_the_outputs_float_arithmetic_would(qtype):
    blocks, weight = blocks_and_weight(qtype, finite=False)  # NaNs, infinities, subnormals as the first scales
    x = activations(4)
    x[1, 7], x[2, 300] = float("nan"), float("inf")
    result, reference = gguf_matmul_cpu.matmul(x, blocks, qtype, OUT), nn.functional.linear(x, weight)
    assert not torch.isfinite(reference).all()
    assert torch.equal(torch.isfinite(result), torch.isfinite(reference))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_same_bits_on_one_thread_and_two(qtype):
    blocks, _ = blocks_and_weight(qtype)
    x = activations(7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = gguf_matmul_cpu.matmul(x, blocks, qtype, OUT)
        torch.set_num_threads(2)
        shared = gguf_matmul_cpu.matmul(x, blocks, qtype, OUT)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_plain_vector_route_gives_the_avx2_routes_bits(qtype):
    if gguf_matmul_cpu.ROUTE != "avx2":
        pytest.skip(f"no AVX2 here (route {gguf_matmul_cpu.ROUTE}): nothing to compare the plain route with")
    blocks, _ = blocks_and_weight(qtype)
    x = activations(6)
    assert torch.equal(gguf_matmul_cpu.matmul(x, blocks, qtype, OUT, route="vector"),
                       gguf_matmul_cpu.matmul(x, blocks, qtype, OUT, route="avx2"))


def test_blocks_that_do_not_hold_the_weight_are_refused():
    blocks, _ = blocks_and_weight(Q.Q8_0)
    with pytest.raises(ValueError, match="do not hold a 49×512 weight"):
        gguf_matmul_cpu.matmul(activations(1), blocks, Q.Q8_0, OUT + 1)


POLICY = make_policy(quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "gguf"}]})


def resident_from_file(tmp_path, qtype: Q, **load) -> tuple[nn.Module, torch.Tensor, streamwise.LoadReport]:
    raw = random_bytes(qtype, (OUT, IN), seed=3)
    path = tmp_path / "resident.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_tensor("proj.weight", raw, raw_dtype=qtype)
    writer.add_tensor("proj.bias", np.random.default_rng(4).standard_normal(OUT, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with streamwise.skeleton():
        model = nn.Sequential()
        model.add_module("proj", nn.Linear(IN, OUT))
    report = streamwise.load(model, path, POLICY, progress=False, **load)
    return model, torch.from_numpy(gguf.quants.dequantize(raw, qtype)), report


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_a_resident_on_the_cpu_computes_from_its_blocks_and_expands_nothing(tmp_path, qtype, monkeypatch):
    model, weight, report = resident_from_file(tmp_path, qtype)
    assert report.cpu_arithmetic == {qtype.name: "int8"} and f"{qtype.name} in int8" in str(report)
    assert report.tiers.working_bytes == 0  # no expansion room counted in the host budget
    monkeypatch.setattr(formats.FORMATS["gguf"], "dequantize", lambda *args: pytest.fail("a weight was expanded"))
    x = activations(3).to(torch.bfloat16)  # the model's dtype is float32; a caller's bf16 comes back bf16
    result = model(x)
    assert result.dtype == torch.bfloat16
    expected = nn.functional.linear(x.float(), weight, model.proj.bias)
    assert relative_l2(result, expected) < INT8_BOUND


def test_the_float32_arithmetic_expands_as_before_bit_for_bit(tmp_path):
    model, weight, report = resident_from_file(tmp_path, Q.Q4_K, arithmetic="float32")
    assert report.cpu_arithmetic == {"Q4_K": "float32"}
    assert report.tiers.working_bytes == 2 * OUT * IN * 4  # the expansion's room, as before
    x = activations(3)
    assert torch.equal(model(x), nn.functional.linear(x, weight, model.proj.bias))


def test_an_unknown_arithmetic_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(ValueError, match="arithmetic 'int4': expected one of int8, float32"):
        resident_from_file(tmp_path, Q.Q8_0, arithmetic="int4")


def test_a_compiled_forward_calls_the_kernel_as_one_operator_without_graph_breaks(tmp_path):
    model, weight, _ = resident_from_file(tmp_path, Q.Q6_K)
    x = activations(2)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    calls = [node.target for graph in explained.graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.streamwise.gguf_matmul in calls
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))


def test_gradients_reach_the_activations_through_the_float_weight(tmp_path):
    model, weight, _ = resident_from_file(tmp_path, Q.Q8_0)
    x = activations(2).requires_grad_()
    model(x).sum().backward()
    assert torch.allclose(x.grad, weight.sum(dim=0).expand(2, -1), rtol=1e-5, atol=1e-5)
