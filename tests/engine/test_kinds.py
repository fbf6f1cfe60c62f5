"""Every compute kind streams bit-identically to the real class it stands for."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamwise
from streamwise.runtime.engine.kinds import COMPUTE_KINDS
from streamwise.schemas.vocabulary import COMPUTE_KINDS as VOCABULARY

from helpers import ChannelsFirstLayerNorm, ChannelsFirstRMSNorm, force_streaming, make_policy, stream_rule

torch.manual_seed(0)


def rms_class(cls_name: str):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.vibevoice.modeling_vibevoice import VibeVoiceRMSNorm
    from transformers.models.vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer import (
        VibeVoiceAcousticTokenizerRMSNorm,
    )

    classes = (VibeVoiceRMSNorm, VibeVoiceAcousticTokenizerRMSNorm, LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm)
    return {c.__name__: c for c in classes}[cls_name]


def with_random_weights(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter.float()).to(parameter.dtype))
    return module


CASES = {
    "linear": (lambda: nn.Linear(8, 6), lambda: torch.randn(2, 3, 8), {}),
    "linear-no-bias-bf16": (lambda: nn.Linear(8, 6, bias=False).bfloat16(), lambda: torch.randn(4, 8).bfloat16(), {}),
    "embedding": (lambda: nn.Embedding(10, 4, padding_idx=0), lambda: torch.tensor([[0, 3, 9, 3]]), {}),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="reflect"), lambda: torch.randn(2, 3, 9), {}),
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, stride=2, dilation=2, groups=2), lambda: torch.randn(1, 4, 11, 11), {}),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, padding=1), lambda: torch.randn(1, 2, 4, 4, 4), {}),
    "conv_transpose1d": (
        lambda: nn.ConvTranspose1d(4, 2, 4, stride=2, padding=1), lambda: torch.randn(1, 4, 7), {"output_size": [15]},
    ),
    "conv_transpose2d": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, output_padding=1), lambda: torch.randn(1, 3, 5, 5), {},
    ),
    "layer_norm": (lambda: nn.LayerNorm(6), lambda: torch.randn(2, 5, 6), {}),
    "group_norm": (lambda: nn.GroupNorm(2, 4), lambda: torch.randn(2, 4, 5), {}),
    "rms_norm": (lambda: nn.RMSNorm(6), lambda: torch.randn(2, 5, 6), {}),
    # (batch, channels, time) with all three different: a transpose of the wrong dimensions cannot pass
    "conv_rms_norm": (lambda: ChannelsFirstRMSNorm(6), lambda: torch.randn(2, 6, 5), {}),
    "conv_rms_norm-bf16": (lambda: ChannelsFirstRMSNorm(6), lambda: torch.randn(2, 6, 5).bfloat16(), {}),
    "conv_layer_norm": (lambda: ChannelsFirstLayerNorm(6), lambda: torch.randn(2, 6, 5), {}),
    "conv_layer_norm-bf16": (lambda: ChannelsFirstLayerNorm(6), lambda: torch.randn(2, 6, 5).bfloat16(), {}),
}
KIND_OF = {name: name.split("-")[0] for name in CASES}
RMS_CLASSES = [
    "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "VibeVoiceRMSNorm", "VibeVoiceAcousticTokenizerRMSNorm",
]


def convert(module: nn.Module, kind: str) -> nn.Sequential:
    container = nn.Sequential(module)
    policy = make_policy(stream={"rule": [stream_rule("only", kind, path="0")]})
    plan = streamwise.resolve(policy, container)
    assert plan.ok, plan.diagnostics
    streamwise.apply(plan, container)
    return container


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_forward_is_bit_identical(case):
    build, make_input, kwargs = CASES[case]
    original = with_random_weights(build())
    x = make_input()
    expected = original(x, **kwargs)
    converted = convert(copy.deepcopy(original), KIND_OF[case])
    assert torch.equal(converted[0](x, **kwargs), expected)  # resident: the original forward
    force_streaming(converted)
    assert torch.equal(converted[0](x, **kwargs), expected)  # streamed: fetched and recomputed


@pytest.mark.parametrize("cls_name", RMS_CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_rms_norms_stream_bit_identically(cls_name, dtype):
    cls = rms_class(cls_name)
    original = with_random_weights(cls(6))
    x = torch.randn(2, 3, 6).to(dtype)  # fp32 weight with bf16 activations: the promotion must survive
    expected = original(x)
    converted = convert(copy.deepcopy(original), "llama_rms_norm")
    force_streaming(converted)
    result = converted[0](x)
    assert result.dtype == expected.dtype and torch.equal(result, expected)


def test_weight_functions_apply_to_a_private_copy():
    original = with_random_weights(nn.Linear(5, 3))
    x = torch.randn(2, 5)
    converted = convert(copy.deepcopy(original), "linear")
    stored = converted[0].weight.detach().clone()
    converted[0].weight_function = [lambda w: w.mul_(2)]  # an in-place patch, like some LoRA math
    assert torch.equal(converted[0](x), nn.functional.linear(x, original.weight * 2, original.bias))
    assert torch.equal(converted[0].weight, stored)


def test_every_kind_of_the_vocabulary_has_a_handler():
    assert sorted(COMPUTE_KINDS) == sorted(VOCABULARY)


def test_streamed_leaves_accept_their_input_by_keyword():
    original = with_random_weights(nn.Linear(4, 3))
    x = torch.randn(2, 4)
    converted = convert(copy.deepcopy(original), "linear")
    assert torch.equal(converted[0](input=x), original(input=x))
    force_streaming(converted)
    assert torch.equal(converted[0](input=x), original(input=x))


def test_the_input_keyword_is_found_among_other_keywords():
    original = with_random_weights(nn.ConvTranspose1d(2, 3, 3, stride=2))
    x = torch.randn(1, 2, 5)
    converted = convert(copy.deepcopy(original), "conv_transpose1d")
    force_streaming(converted)
    expected = original(x, output_size=[12])
    assert torch.equal(converted[0](output_size=[12], input=x), expected)


def test_arguments_after_the_input_pass_through_in_their_places():
    original = with_random_weights(nn.ConvTranspose1d(4, 2, 4, stride=2, padding=1))
    x = torch.randn(1, 4, 7)
    converted = convert(copy.deepcopy(original), "conv_transpose1d")
    force_streaming(converted)
    assert torch.equal(converted[0](x, [15]), original(x, output_size=[15]))  # output_size, positionally


@pytest.mark.parametrize("call", [lambda leaf: leaf(), lambda leaf: leaf(hidden=torch.randn(1, 4))],
                         ids=["nothing", "another-keyword"])
def test_a_leaf_called_without_its_input_says_how_to_pass_it(call):
    converted = convert(with_random_weights(nn.Linear(4, 3)), "linear")
    force_streaming(converted)
    with pytest.raises(TypeError, match=r"^Linear\.forward\(\) got no input: pass it first or as `input=`$"):
        call(converted[0])


def test_a_transposed_convolution_refuses_a_padding_mode_it_cannot_compute_as_its_class_does():
    """Only `zeros` exists for transposed convolutions; one set afterwards is refused as the class refuses it."""
    layer = with_random_weights(nn.ConvTranspose1d(2, 3, 3))
    layer.padding_mode = "reflect"
    converted = convert(layer, "conv_transpose1d")
    force_streaming(converted)
    with pytest.raises(ValueError, match="only `zeros` padding mode is supported for ConvTranspose1d"):
        converted[0](torch.randn(1, 2, 5))


def test_an_input_dtype_kind_fetches_its_weights_in_the_inputs_dtype():
    """A bfloat16 layer fed float32 computes in float32, as ComfyUI's cast layers do (the stored weights stay)."""
    stored = with_random_weights(nn.Linear(8, 4)).bfloat16()
    x = torch.randn(3, 8)
    converted = convert(copy.deepcopy(stored), "linear")
    force_streaming(converted)
    result = converted[0](x)
    assert result.dtype == torch.float32
    assert torch.equal(result, nn.functional.linear(x, stored.weight.float(), stored.bias.float()))
    assert converted[0].weight.dtype == torch.bfloat16


def test_a_registered_kind_cannot_be_changed_in_place():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        COMPUTE_KINDS["linear"].dtype = "stored"
