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
from streamwise.runtime.quant import formats, numba_kernels
from streamwise.runtime.quant.gguf_dequant import dequantize
from streamwise.runtime.quant.int4 import _rotated_weight

from helpers import make_policy

cpu_matmul = pytest.importorskip("streamwise.runtime.quant.cpu_matmul", reason="numba is not installed")

Q = gguf.GGMLQuantizationType
CONVROT_INT4 = cpu_matmul.CONVROT_INT4
LAYOUTS = sorted(cpu_matmul.LAYOUTS, key=str)  # the GGML types, then ConvRot INT4
OUT, IN = 48, 512  # two K-quant blocks, sixteen Q8_0 blocks, eight INT4 scale groups per row
INT8_BOUND = 1e-2
"""The int8 arithmetic's stated bound against dequantize → F.linear in float32 (relative L2, random data)."""


def name(layout) -> str:
    return layout if isinstance(layout, str) else layout.name


def relative_l2(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.double() - reference.double()).norm() / reference.double().norm()).item()


def stored_and_weight(layout, seed: int = 0, finite: bool = True):
    """Random storage in `layout`, its scales apart (ConvRot INT4's) or None, and the float weight it holds (INT4's
    in its rotated basis, which the kernel multiplies the rotated activations with)."""
    if layout != CONVROT_INT4:
        raw = torch.from_numpy(random_bytes(layout, (OUT, IN), seed=seed, finite=finite)).reshape(-1)
        return raw, None, dequantize(raw, layout, (OUT, IN), torch.float32)
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (OUT, IN // 2), dtype=torch.uint8, generator=generator)
    scales = torch.rand(OUT, IN // 64, generator=generator) * 0.1
    if not finite:
        scales[:3, 0] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return packed, scales, _rotated_weight(packed, scales, 256)


def activations(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(seed))


def rounded(x: torch.Tensor, layout) -> torch.Tensor:
    """The activations as the kernels multiply them: their int8 values times their group's scale."""
    group = cpu_matmul.LAYOUTS[layout].block_size
    values, scales, _ = cpu_matmul.quantize_activations(x, group)
    return (values.double().reshape(len(x), -1, group) * scales.double()[..., None]).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 5, 32], ids=lambda r: f"{r}rows")  # one row; four together and one; many
@pytest.mark.parametrize("layout", LAYOUTS, ids=name)
def test_a_kernel_computes_the_rounded_activations_times_the_weight_within_the_int8_bound(layout, rows):
    stored, scales, weight = stored_and_weight(layout)
    x = activations(rows)
    result = cpu_matmul.matmul(x, stored, layout, OUT, scales)
    assert result.shape == (rows, OUT) and result.dtype == torch.float32
    # exactly the arithmetic it claims: only the activations' rounding differs from float32 (summation order aside)
    assert relative_l2(result, rounded(x, layout) @ weight.double().T) < 1e-6
    assert relative_l2(result, nn.functional.linear(x, weight)) < INT8_BOUND


@pytest.mark.parametrize("group", [32, 64, 256])
def test_activations_round_to_nearest_with_the_largest_magnitude_at_127(group):
    x = activations(3) * torch.logspace(-3, 3, IN)  # groups of very different sizes
    x[1, :group] = 0  # an all-zero group: scale 0, values 0
    values, scales, sums = cpu_matmul.quantize_activations(x, group)
    grouped, scale = values.reshape(3, -1, group), scales[..., None]
    assert torch.all((x.reshape(3, -1, group) - grouped * scale).abs() <= scale / 2 * (1 + 1e-6))
    assert torch.all(grouped.abs().amax(dim=-1) == torch.where(scales > 0, 127, 0))
    assert torch.equal(sums, values.reshape(3, -1, 32).sum(dim=-1).float())


@pytest.mark.parametrize("layout", LAYOUTS, ids=name)
def test_non_finite_scales_and_activations_reach_the_outputs_float_arithmetic_would(layout):
    stored, scales, weight = stored_and_weight(layout, finite=False)  # NaNs, infinities (and subnormals) as scales
    x = activations(4)
    x[1, 7], x[2, 300] = float("nan"), float("inf")
    result, reference = cpu_matmul.matmul(x, stored, layout, OUT, scales), nn.functional.linear(x, weight)
    assert not torch.isfinite(reference).all()
    assert torch.equal(torch.isfinite(result), torch.isfinite(reference))


@pytest.mark.parametrize("layout", LAYOUTS, ids=name)
def test_the_same_bits_on_one_thread_and_two(layout, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "_BYTES_PER_THREAD", 1)  # a second thread even for so small a weight
    stored, scales, _ = stored_and_weight(layout)
    x = activations(7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_matmul.matmul(x, stored, layout, OUT, scales)
        torch.set_num_threads(2)
        shared = cpu_matmul.matmul(x, stored, layout, OUT, scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)


@pytest.mark.parametrize("layout", LAYOUTS, ids=name)
def test_the_plain_vector_route_gives_the_avx2_routes_bits(layout):
    if cpu_matmul.ROUTE != "avx2":
        pytest.skip(f"no AVX2 here (route {cpu_matmul.ROUTE}): nothing to compare the plain route with")
    stored, scales, _ = stored_and_weight(layout)
    x = activations(6)
    assert torch.equal(cpu_matmul.matmul(x, stored, layout, OUT, scales, route="vector"),
                       cpu_matmul.matmul(x, stored, layout, OUT, scales, route="avx2"))


def test_storage_that_does_not_hold_the_weight_or_scales_that_do_not_fit_are_refused():
    blocks, _, _ = stored_and_weight(Q.Q8_0)
    with pytest.raises(ValueError, match="does not hold a 49×512 weight"):
        cpu_matmul.matmul(activations(1), blocks, Q.Q8_0, OUT + 1)
    packed, scales, _ = stored_and_weight(CONVROT_INT4)
    with pytest.raises(ValueError, match=r"convrot_int4 weights take scales of shape \(48, 8\)"):
        cpu_matmul.matmul(activations(1), packed, CONVROT_INT4, OUT, scales[:, :4])
    with pytest.raises(ValueError, match="q8_0 weights take no scales apart"):
        cpu_matmul.matmul(activations(1), blocks, Q.Q8_0, OUT, scales)


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


def int4_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT))
    policy = make_policy(quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "convrot_int4"}]})
    streamwise.apply(streamwise.resolve(policy, model), model)
    return model


def test_a_convrot_int4_resident_on_the_cpu_computes_from_its_packed_values(monkeypatch):
    model = int4_model()
    layer = model[0]
    weight = formats.FORMATS["convrot_int4"].dequantize(layer, {n: layer._parameters[n] for n in
                                                               ("weight", "weight_scale")}, torch.float32)
    monkeypatch.setattr(formats.FORMATS["convrot_int4"], "dequantize", lambda *a: pytest.fail("a weight was expanded"))
    x = activations(3)
    assert relative_l2(model(x), nn.functional.linear(x, weight, layer.bias)) < INT8_BOUND


def test_a_convrot_int4_resident_with_scale_groups_the_kernel_cannot_read_takes_the_float_route():
    model = nn.Sequential(nn.Linear(IN, OUT))
    policy = make_policy(quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "convrot_int4",
                                          "group_size": 16}]})  # scale groups of 16
    streamwise.apply(streamwise.resolve(policy, model), model)
    layer = model[0]
    assert formats.FORMATS["convrot_int4"].cpu_arithmetic(layer) == "float32"
    x = activations(2)
    stored = {n: layer._parameters[n] for n in ("weight", "weight_scale")}
    expected = nn.functional.linear(x, formats.FORMATS["convrot_int4"].dequantize(layer, stored, torch.float32),
                                    layer.bias)
    assert relative_l2(model(x), expected) < 1e-6


def test_without_numbas_kernels_residents_take_the_float_route_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr(numba_kernels, "matmul", lambda: None)  # numba not installed, or unable to build them
    model, weight, report = resident_from_file(tmp_path, Q.Q6_K)
    assert report.cpu_arithmetic == {"Q6_K": "float32"} and report.tiers.working_bytes == 2 * OUT * IN * 4
    x = activations(3)
    assert torch.equal(model(x), nn.functional.linear(x, weight, model.proj.bias))
