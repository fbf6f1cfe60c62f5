"""Units for models that declare no blocks: where neither the policy, `_no_split_modules` nor diffusers'
`_repeated_blocks` names a tree's blocks, they are found (the repeated children of its largest ModuleList or
Sequential), so a root's direct parameters never make the whole model one streamed unit; and the only unit, when
one is, is named if it is larger than its share of the budget."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import streamwise
from streamwise.runtime.plan.auto import select_policy
from streamwise.runtime.plan.selectors import REPEATED, declared_blocks, found_blocks, walk_modules

from helpers import make_policy


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
        return self.proj(weights @ v)


class Block(nn.Module):
    """A block no library declares: norms, attention and an MLP, as timm's ViT lays them out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(width), Attention(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """timm's VisionTransformer layout: direct parameters on the root above `blocks`, a Sequential nobody declares."""

    def __init__(self, width: int = 32, depth: int = 4, patch: int = 4, image: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width))
        self.patch_embed = nn.Conv2d(3, width, patch, patch)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, pixels):
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return ViT().eval()


def _vit_inputs() -> dict:
    return {"pixels": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))}


def _ltx() -> nn.Module:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        num_layers=2, caption_channels=16).eval()


def _ltx_inputs() -> dict:
    generator = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 8, 4, generator=generator),
            "encoder_hidden_states": torch.randn(1, 3, 16, generator=generator),
            "timestep": torch.tensor([500]), "encoder_attention_mask": torch.ones(1, 3),
            "num_frames": 2, "height": 2, "width": 2, "return_dict": False}


def _run(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, tuple) else out


MODELS = {"vit": (_vit, _vit_inputs), "ltx": (_ltx, _ltx_inputs)}


def test_the_vit_declares_nothing_and_its_blocks_are_found():
    walk = walk_modules(_vit())
    assert declared_blocks(walk, REPEATED) == frozenset()
    assert found_blocks(walk) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]  # not the MLPs' mixed Sequentials


def test_ltx_declares_its_blocks_only_in_repeated_blocks():
    model = _ltx()
    assert type(model)._no_split_modules is None
    walk = walk_modules(model)
    assert declared_blocks(walk) == frozenset() and declared_blocks(walk, REPEATED) == {"LTXVideoTransformerBlock"}


@pytest.mark.parametrize("name, own", [("vit", ("cls_token", "pos_embed")), ("ltx", ("scale_shift_table",))])
def test_the_roots_own_parameters_follow_the_device_instead_of_streaming_the_whole_model(name, own):
    build, _ = MODELS[name]
    choice = select_policy(build())
    assert choice.policy.name == "any-module"
    root = choice.resolved[0].module("")
    assert (root.stream, root.relocate) == (None, own)
    assert "holds the model's blocks" in root.kind_reason
    assert not choice.resolved[0].coverage.stranded


@pytest.mark.parametrize("name", MODELS)
def test_half_the_budget_keeps_part_resident_and_every_budget_computes_the_same(name):
    build, inputs = MODELS[name]
    expected = _run(build(), inputs())
    streamed = build()
    everything = streamwise.offload(streamed, "auto", device="cpu", budget=0).streamed_bytes
    assert torch.equal(_run(streamed, inputs()), expected)
    half = build()
    report = streamwise.offload(half, "auto", device="cpu", budget=everything // 2)
    assert report.resident_modules > 0 and report.streamed_modules > 0
    assert 0 < report.resident_bytes <= everything // 2 and report.streamed_bytes >= everything // 2
    assert torch.equal(_run(half, inputs()), expected)
    resident = build()
    assert streamwise.offload(resident, "auto", device="cpu", budget=None).streamed_modules == 0
    assert torch.equal(_run(resident, inputs()), expected)


class ScaledBlock(Block):
    """A block holding a direct parameter of its own (a layer scale)."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.gamma = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return super().forward(x) * self.gamma


def _scaled_vit() -> nn.Module:
    torch.manual_seed(0)
    model = ViT()
    model.blocks = nn.Sequential(*[ScaledBlock(32) for _ in range(4)])
    return model.eval()


def test_a_found_block_holding_parameters_is_one_unit():
    plan = streamwise.resolve(streamwise.load_policy("any-module"), _scaled_vit())
    assert plan.module("").relocate == ("cls_token", "pos_embed")
    assert [e.path for e in plan.modules if e.stream == "generic"] == [f"blocks.{i}" for i in range(4)]


def test_the_policys_blocks_come_first_and_nothing_is_searched_for_then():
    policy = make_policy(stream={"rule": [{"id": "all", "kind": "auto", "select": {"holds": "parameters"}}]},
                         compile={"blocks": {"class": "Attention"}})
    model, inputs = _scaled_vit(), _vit_inputs()
    expected = _run(model, inputs)
    plan = streamwise.resolve(policy, model)
    assert plan.module("").relocate == ("cls_token", "pos_embed")  # the blocks the policy names lie below the root
    block = plan.module("blocks.0")  # above the policy's blocks, so not one unit: its layer scale relocates
    assert (block.stream, block.relocate) == (None, ("gamma",))
    assert "blocks.0.attn" in [entry.path for entry in plan.modules if entry.compile_unit]
    streamwise.offload(model, policy, device="cpu", budget=0)
    assert torch.equal(_run(model, inputs), expected)


class Flat(nn.Module):
    """Direct parameters above layers that do not repeat: no blocks to find, so the root is the only unit."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.inner = nn.Linear(16, 16)
        self.mixed = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x):
        return self.mixed(self.inner(x) * self.scale)


def test_nothing_repeats_in_a_flat_tree():
    assert found_blocks(walk_modules(Flat())) == []
    assert found_blocks(walk_modules(nn.ModuleList([nn.Linear(2, 2)]))) == []  # one is not repeated


def test_the_largest_repeated_list_is_the_blocks():
    model = nn.Module()
    model.small = nn.ModuleList([nn.Linear(2, 2) for _ in range(8)])
    model.large = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
    assert found_blocks(walk_modules(model)) == ["large.0", "large.1"]


@pytest.mark.parametrize("budget", [0, 1000])
def test_the_only_unit_larger_than_its_share_is_named(budget, caplog):
    torch.manual_seed(0)
    model, x = Flat(), torch.randn(2, 16)
    expected = model(x)
    with caplog.at_level(logging.INFO, logger="streamwise.offload"):
        report = streamwise.offload(model, "any-module", device="cpu", budget=budget)
    assert report.streamed_modules + report.resident_modules == 1  # the root, with what it claims
    (unit, size), = report.large_units
    assert unit == "" and size == report.streamed_bytes > 1000
    (record,) = [r for r in caplog.records if r.name == "streamwise.offload"]
    assert record.levelno == logging.WARNING and "units larger than 50% of the budget: `<root>`" in record.getMessage()
    assert torch.equal(model(x), expected)


def test_the_only_unit_within_its_share_is_not_named(caplog):
    with caplog.at_level(logging.INFO, logger="streamwise.offload"):
        report = streamwise.offload(Flat(), "any-module", device="cpu", budget="1MiB")
    assert report.large_units == () and report.resident_modules == 1
    assert [r.levelno for r in caplog.records if r.name == "streamwise.offload"] == [logging.INFO]
