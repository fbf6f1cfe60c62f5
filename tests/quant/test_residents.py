"""Quantized residents: accuracy, streaming in raw dtype, LoRA on the dequantized weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamwise
from streamwise.runtime.engine import protocol
from streamwise.runtime.quant import int8 as int8_math
from streamwise.runtime.quant.convrot import check_group_size, hadamard, rotate, unrotate
from streamwise.runtime.quant.int4 import dequantize_int4, quantize_int4
from streamwise.runtime.quant.int8 import dequantize_int8, quantize_int8

from helpers import force_streaming, make_policy, stream_rule


def per_row_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return ((output - reference).norm(dim=-1) / reference.norm(dim=-1)).max().item()


@pytest.mark.parametrize("group_size", [4, 16, 64, 256])
def test_hadamard_is_orthonormal_regular_and_its_own_inverse(group_size):
    h = hadamard(group_size, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(group_size, dtype=torch.float64))
    assert torch.allclose(h.sum(dim=1).abs(), torch.ones(group_size, dtype=torch.float64))  # regular: equal row sums
    x = torch.randn(3, 2 * group_size, dtype=torch.float64)
    assert torch.allclose(unrotate(rotate(x, group_size), group_size), x)


@pytest.mark.parametrize("size, in_features", [(8, 256), (256, 384), (2, 8)])
def test_group_sizes_must_be_powers_of_4_dividing_in_features(size, in_features):
    with pytest.raises(ValueError):
        check_group_size(size, in_features)


def test_int8_per_row_error_is_within_1_percent_on_gaussian_activations():
    torch.manual_seed(0)
    weight, x = torch.randn(256, 1024), torch.randn(32, 1024)
    q, scale = quantize_int8(weight)
    error = per_row_error(int8_math.int8_linear(x, q, scale, None, None), x @ weight.T)
    assert error <= 0.01, error  # measured 0.95% (W8A16 with bf16 activations on the CPU)


def test_convrot_beats_plain_int8_when_activations_have_outlier_channels():
    torch.manual_seed(0)
    weight = torch.randn(256, 1024) / 32
    x = torch.randn(32, 1024)
    x[:, torch.randperm(1024)[:8]] *= 50  # eight strong outlier channels
    reference = x @ weight.T
    plain_q, plain_scale = quantize_int8(weight)
    rot_q, rot_scale = quantize_int8(weight, 256)
    plain = per_row_error(int8_math._w8a8(x, plain_q, plain_scale), reference)  # W8A8: activations quantized too
    convrot = per_row_error(int8_math._w8a8(rotate(x, 256), rot_q, rot_scale), reference)
    assert convrot < plain / 3, (plain, convrot)  # measured 6.6% plain vs 1.3% ConvRot


def test_convrot_int4_error_bound():
    """W4 symmetric with 64-channel scales after rotation: per-row output error below 15%."""
    torch.manual_seed(0)
    weight, x = torch.randn(128, 512), torch.randn(16, 512)
    packed, scale = quantize_int4(weight, 256)
    assert packed.dtype == torch.uint8 and packed.shape == (128, 256) and scale.shape == (128, 8)
    error = per_row_error(x @ dequantize_int4(packed, scale, 256, torch.float32).T, x @ weight.T)
    assert error <= 0.15, error  # measured 12.8%


def test_int8_dequantize_round_trip_is_within_half_a_step():
    weight = torch.randn(16, 64)
    q, scale = quantize_int8(weight, 16)
    assert (dequantize_int8(q, scale, 16, torch.float32) - weight).abs().max() <= scale.max() * 0.5 * 16**0.5


POLICY = dict(
    stream={"rule": [stream_rule("linear", "linear", **{"class": "Linear"})]},
)


def quantized(model: nn.Module, fmt: str, group_size: int | None = None) -> nn.Module:
    rule = {"id": "q", "select": {"class": "Linear"}, "format": fmt}
    if group_size:
        rule["group_size"] = group_size
    policy = make_policy(**POLICY, quant={"rule": [rule]})
    streamwise.apply(streamwise.resolve(policy, model), model)
    return model


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16, bias=False))


@pytest.mark.parametrize("fmt, group_size, storage", [
    ("int8", None, torch.int8), ("convrot_int8", 16, torch.int8), ("convrot_int4", 16, torch.uint8),
])
def test_residents_stream_their_raw_storage_and_match_resident_compute(fmt, group_size, storage):
    model = quantized(two_layers(), fmt, group_size)
    first = model[0]
    assert first._parameters["weight"].dtype == storage and first.weight_comfy_model_dtype == storage
    assert first.weight.dtype == torch.float32 and first.weight.shape == (32, 64)  # what model code sees
    assert first.weight_scale.dtype == torch.float32
    x = torch.randn(5, 64)
    resident = model(x)
    fetched = []
    fetcher = streamwise.runtime.convert.applied_state(model).tree.fetcher
    original_fetch = fetcher.fetch_raw

    def fetch_raw(module, names, device):
        fetched.append([module._parameters[n].dtype for n in names if module._parameters.get(n) is not None])
        return original_fetch(module, names, device)

    fetcher.fetch_raw = fetch_raw
    force_streaming(model)
    assert torch.equal(model(x), resident)
    assert fetched[0][0] == storage  # never cast on the way


@pytest.mark.parametrize("fmt, group_size", [("int8", None), ("convrot_int8", 16), ("convrot_int4", 16)])
def test_weight_functions_apply_to_the_dequantized_weight(fmt, group_size):
    model = quantized(two_layers(), fmt, group_size)
    layer = model[0]
    from streamwise.runtime.quant.formats import FORMATS

    stored = {name: layer._parameters[name] for name in FORMATS[fmt].stored}
    dequantized = FORMATS[fmt].dequantize(layer, stored, torch.float32)
    delta = torch.randn_like(dequantized) * 0.01
    layer.weight_function = [lambda w: w + delta]
    x = torch.randn(4, 64)
    assert torch.allclose(layer(x), nn.functional.linear(x, dequantized + delta, layer.bias), atol=1e-5)


@pytest.mark.parametrize("fmt, group_size", [("int8", None), ("convrot_int4", 16)])
def test_a_patch_core_dynamic_vram_sets_beside_the_weight_applies_before_the_weight_functions(fmt, group_size):
    """Newer cores' dynamic-VRAM loading puts a weight's LoRA in `weight_lowvram_function` (and the bias's in
    `bias_lowvram_function`), not in the weight functions: a resident that ignored it computed without the LoRA."""
    model = quantized(two_layers(), fmt, group_size)
    layer = model[0]
    from streamwise.runtime.quant.formats import FORMATS

    dequantized = FORMATS[fmt].dequantize(layer, {n: layer._parameters[n] for n in FORMATS[fmt].stored},
                                          torch.float32)
    delta, shift = torch.randn_like(dequantized) * 0.01, torch.randn_like(layer.bias)
    layer.weight_lowvram_function = lambda w: w + delta
    layer.bias_lowvram_function = lambda b: b + shift
    layer.weight_function = [lambda w: w * 2]  # after the patch, as core applies them
    layer.comfy_cast_weights = True  # core's dynamic loading streams the modules it patches so
    x = torch.randn(4, 64)
    expected = nn.functional.linear(x, (dequantized + delta) * 2, layer.bias + shift)
    assert torch.allclose(layer(x), expected, atol=1e-5)
    layer.comfy_cast_weights = False  # unloaded: core never clears the patch, and applies it only when casting
    assert torch.allclose(layer(x), nn.functional.linear(x, dequantized * 2, layer.bias), atol=1e-5)


@pytest.mark.parametrize("fmt, group_size", [("int8", None), ("convrot_int4", 16)])
def test_in_place_bias_functions_never_touch_the_stored_bias(fmt, group_size):
    model = quantized(two_layers(), fmt, group_size)
    layer = model[0]
    stored = layer.bias.detach().clone()
    layer.bias_function = [lambda b: b.add_(1)]  # ComfyUI's LoRA math may add in place
    x = torch.randn(4, 64)
    with torch.no_grad():
        first, second = layer(x), layer(x)
    assert torch.equal(first, second)
    assert torch.equal(layer.bias, stored)


def test_int4_residents_say_they_are_not_compile_safe():
    from streamwise.runtime.engine import protocol

    assert protocol.quant_handler(quantized(two_layers(), "convrot_int4", 16)[0]).compile_safe is False
    assert protocol.quant_handler(quantized(two_layers(), "convrot_int8", 16)[0]).compile_safe is True


def test_quantized_trees_cannot_be_reverted():
    model = quantized(two_layers(), "int8")
    with pytest.raises(streamwise.runtime.convert.ConversionError, match="quantized residents"):
        streamwise.revert(model)


def test_a_group_size_that_does_not_divide_in_features_is_a_plan_error():
    rule = {"id": "q", "select": {"class": "Linear"}, "format": "convrot_int8", "group_size": 64}
    policy = make_policy(**POLICY, quant={"rule": [rule]})
    plan = streamwise.resolve(policy, two_layers())  # in_features 64 and 32
    (problem,) = [d for d in plan.diagnostics if d.code == "invalid-group-size"]
    assert problem.message.endswith("group size 64 does not divide in_features 32 (module: `1`)")


def test_small_layers_stay_float_below_min_weights():
    rule = {"id": "q", "select": {"class": "Linear"}, "format": "int8", "min_weights": 1000}
    model = two_layers()  # 64x32 = 2048 weights, then 32x16 = 512
    streamwise.apply(streamwise.resolve(make_policy(**POLICY, quant={"rule": [rule]}), model), model)
    assert [m._parameters["weight"].dtype for m in model] == [torch.int8, torch.float32]


def test_int8_on_the_cpu_handles_in_features_the_packed_kernel_cannot():
    torch.manual_seed(0)
    weight, x = torch.randn(24, 40), torch.randn(3, 40)  # 40 is not a multiple of 16
    q, scale = quantize_int8(weight)
    assert per_row_error(int8_math.int8_linear(x, q, scale, None, None), x @ weight.T) < 0.01


def test_int4_casts_a_float32_bias_for_bf16_activations():
    model = quantized(two_layers(), "convrot_int4", 16)
    assert model(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_a_failing_quantization_leaves_the_tree_unchanged(monkeypatch):
    from streamwise.runtime.quant.formats import FORMATS

    model = two_layers()
    calls = []
    real = FORMATS["int8"].quantize

    def flaky(weight, group_size):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of memory")
        return real(weight, group_size)

    monkeypatch.setattr(FORMATS["int8"], "quantize", flaky)
    with pytest.raises(streamwise.runtime.convert.ConversionError, match="out of memory"):
        quantized(model, "int8")
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]
    assert all(m.weight.dtype == torch.float32 for m in model)
    assert streamwise.runtime.convert.applied_state(model) is None


def test_comfy_quant_cannot_describe_int4_residents():
    from streamwise.runtime.checkpoint import comfy_quant

    with pytest.raises(ValueError, match="convrot_int4"):
        comfy_quant.state_dict(quantized(two_layers(), "convrot_int4", 16))


def test_residents_never_keep_misaligned_storage():
    """torch's packed INT8 CPU kernel crashes on storage that is not 16-byte aligned (file-map views)."""
    from streamwise.runtime.quant.residents import make_resident

    q, scale = quantize_int8(torch.randn(16, 64))
    buffer = torch.zeros(q.numel() + 8, dtype=torch.int8)
    misaligned = buffer[8:].view(16, 64)
    misaligned.copy_(q)
    layer = nn.Linear(64, 16)
    make_resident(layer, "int8", {"weight": misaligned, "weight_scale": scale}, {protocol.GROUP_SIZE: None})
    assert layer._parameters["weight"].data_ptr() % 64 == 0
    assert torch.equal(layer._parameters["weight"], q)
    layer(torch.randn(2, 64))


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    from streamwise.runtime.engine import protocol

    handler = protocol.quant_handler(layer)
    return handler.dequantize(layer, {name: layer._parameters[name] for name in handler.stored}, torch.float32)


@pytest.mark.parametrize("fmt, group_size", [("int8", None), ("convrot_int8", 16), ("convrot_int4", 16)])
def test_residents_take_strided_inputs_and_the_keyword_input(fmt, group_size):
    layer = quantized(two_layers(), fmt, group_size)[0]
    x = torch.randn(1, 64, 7).transpose(1, 2)  # a channels-first model's features: rows not contiguous
    assert not x.reshape(-1, 64).is_contiguous()
    expected = nn.functional.linear(x, dequantized_weight(layer), layer.bias)
    with torch.no_grad():
        assert per_row_error(layer(input=x).reshape(7, -1), expected.reshape(7, -1)) < 0.01


def test_int8_row_scales_survive_float16_activations():
    """A row whose largest weight is below 7.8e-3 has a scale that float16 holds only as a subnormal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    with torch.no_grad():
        model[0].weight.mul_(1e-4)
    layer = quantized(model, "int8")[0]
    x = torch.randn(8, 64)
    expected = x @ dequantized_weight(layer).T
    with torch.no_grad():
        assert per_row_error(layer(x.half()).float(), expected) < 0.01  # 23% when the scale was cast to float16


def test_int8_gradients_reach_the_activations():
    layer = quantized(two_layers(), "int8")[0]
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).square().sum().backward()
    reference = x.detach().clone().requires_grad_()
    nn.functional.linear(reference, dequantized_weight(layer), layer.bias).square().sum().backward()
    assert per_row_error(x.grad, reference.grad) < 0.01


def test_a_float_gguf_resident_gives_in_place_weight_functions_a_copy():
    """F32 bytes read as float32 are a view of the stored blocks: a LoRA patch may write into what it gets."""
    import gguf

    from streamwise.runtime.quant.residents import make_resident

    model = nn.Sequential(nn.Linear(8, 4, bias=False))
    streamwise.apply(streamwise.resolve(make_policy(**POLICY), model), model)
    layer = model[0]
    stored = layer.weight.detach().clone().view(torch.uint8).reshape(-1)
    attributes = {"gguf_qtype": gguf.GGMLQuantizationType.F32, "gguf_shape": (4, 8)}
    make_resident(layer, "gguf", {"weight": stored}, attributes)
    before = layer._parameters["weight"].detach().clone()
    layer.weight_function = [lambda w: w.add_(1)]
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x))
    assert torch.equal(layer._parameters["weight"], before)
