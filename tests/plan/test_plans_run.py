"""Plans that run, with units sized for the budget: what `auto` plans never raises at the first forward, never makes
the whole model one streamed unit, and streams the real parameters of `weight_norm` and parametrized modules."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers as T
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import streamwise
from streamwise.runtime.hosts.standalone import UNIT_SHARE
from streamwise.runtime.plan.auto import select_policy

from helpers import make_policy, stream_rule


def _siglip() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = T.SiglipConfig(text_config=dict(layers, vocab_size=64, max_position_embeddings=16, bos_token_id=1,
                                             eos_token_id=2, pad_token_id=0),
                            vision_config=dict(layers, image_size=16, patch_size=8))
    inputs = {"input_ids": torch.tensor([[1, 5, 9, 2]]), "pixel_values": torch.randn(1, 3, 16, 16)}
    return T.SiglipModel(config).eval(), inputs


def _logits(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits_per_image


def test_the_roots_own_parameters_follow_the_device_instead_of_streaming_the_whole_model():
    model, inputs = _siglip()
    expected = _logits(model, inputs)
    plan = select_policy(model).resolved[0]
    root = plan.module("")
    assert (root.stream, root.relocate) == (None, ("logit_scale", "logit_bias"))
    assert "holds the model's blocks" in root.kind_reason
    assert not plan.coverage.stranded
    report = streamwise.offload(model, "auto", device="cpu", budget="40KiB")
    assert report.resident_modules > 0 and report.streamed_modules > 0  # a partial budget keeps part resident
    assert torch.equal(_logits(model, inputs), expected)


def test_budget_zero_and_fully_resident_agree_for_a_root_with_parameters():
    model, inputs = _siglip()
    resident, streamed = _siglip()[0], _siglip()[0]
    streamwise.offload(resident, "auto", device="cpu", budget=None)
    streamwise.offload(streamed, "auto", device="cpu", budget=0)
    assert torch.equal(_logits(resident, inputs), _logits(streamed, inputs))
    assert torch.equal(_logits(streamed, inputs), _logits(model, inputs))


class Table(nn.Module):
    """A learned table read without an input (positional embeddings, prompt tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 8))

    def forward(self):
        return self.table


class Sized(nn.Module):
    """A learned table sliced by a plain int."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))

    def forward(self, length: int):
        return self.table[:length]


class Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table, self.sized, self.proj = Table(), Sized(), nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x + self.table().sum(0) + self.sized(3).sum(0))


def test_a_module_whose_forward_takes_no_input_relocates_and_one_taking_no_tensor_fetches_to_the_device():
    torch.manual_seed(0)
    model, x = Reader(), torch.randn(2, 8)
    expected = model(x)
    plan = streamwise.resolve(streamwise.load_policy("any-module"), model)
    assert (plan.module("table").stream, plan.module("table").relocate) == (None, ("table",))
    assert plan.module("sized").stream == "generic"  # takes an int: fetched to the tree's compute device
    streamwise.offload(model, "any-module", device="cpu", budget=0)
    assert torch.equal(model(x), expected)


def _weight_normed() -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old-style weight_norm, still in diffusers' audio VAEs
        old = nn.utils.weight_norm(nn.Conv1d(4, 4, 3, padding=1))
    return nn.Sequential(old, weight_norm(nn.Conv1d(4, 4, 3, padding=1)))


def test_weight_norm_in_either_style_streams_its_real_parameters():
    model, x = _weight_normed(), torch.randn(1, 4, 8)
    expected = model(x)
    plan = streamwise.resolve(streamwise.load_policy("any-module"), model)
    assert plan.coverage.stranded == () and {e.stream for e in plan.modules if e.stream} == {"generic"}
    streamwise.offload(model, "any-module", device="cpu", budget=0)
    stored = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert torch.equal(model(x), expected)
    with torch.no_grad():  # what the forward computes from comes through the fetch, not the stored tensors
        for tensor in model.state_dict(keep_vars=True).values():
            tensor.mul_(2)
    assert not torch.equal(model(x), expected)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            tensor.copy_(stored[name])
    assert torch.equal(model(x), expected)


def test_a_specific_kind_named_for_a_weight_normed_module_is_a_located_error():
    policy = make_policy(stream={"rule": [stream_rule("convs", "conv1d", **{"class": "Conv1d"})]})
    plan = streamwise.resolve(policy, _weight_normed())
    (problem,) = [d for d in plan.diagnostics if d.is_error]
    assert problem.code == "kind-mismatch"
    assert "`Conv1d` computes its `weight` from other parameters (`weight_norm`, or a hook)" in problem.message
    assert problem.message.endswith("(module: `0`)")


def test_a_unit_larger_than_its_share_of_the_budget_is_named(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))  # 16.6 KiB and 1 KiB
    with caplog.at_level(logging.WARNING, logger="streamwise.offload"):
        report = streamwise.offload(model, "any-module", device="cpu", budget="20KiB")
    assert [path for path, _ in report.large_units] == ["0"] and report.large_units[0][1] > UNIT_SHARE * 20 * 1024
    assert "units larger than 50% of the budget: `0` (16.2 KiB)" in str(report)
    assert any("units larger than" in r.getMessage() for r in caplog.records)
    assert streamwise.offload(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "any-module", device="cpu",
                              budget="1MiB").large_units == ()


@pytest.mark.parametrize("budget", [0, None])
def test_the_root_never_becomes_one_unit_under_auto(budget):
    model, _ = _siglip()
    report = streamwise.offload(model, "auto", device="cpu", budget=budget)
    assert report.large_units == () and report.streamed_modules + report.resident_modules > 10
