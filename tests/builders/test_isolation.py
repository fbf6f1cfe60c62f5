"""Building a skeleton changes nothing for the rest of the process: another thread meanwhile builds ordinary models
(real parameters, torch's default dtype), and the default dtype itself never changes."""

from __future__ import annotations

import contextlib
import importlib
import threading

import torch
from torch import nn

from streamwise.runtime.builders.skeleton import build_skeleton, skeleton

build_dtype = importlib.import_module("streamwise.runtime.builders.build_dtype")
UNPATCHED = (nn.Module.register_parameter, torch.get_default_dtype)


def built_elsewhere(*contexts) -> dict:
    """What a model built in another thread looks like while `contexts` are entered here."""
    seen: dict = {}
    entered, done = threading.Event(), threading.Event()

    def build() -> None:
        entered.wait(timeout=30)
        layer = nn.Linear(4, 4)
        seen.update(device=layer.weight.device.type, dtype=layer.weight.dtype, default=torch.get_default_dtype(),
                    tensor=torch.tensor(0.5).dtype)
        done.set()

    thread = threading.Thread(target=build)
    thread.start()
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        here = nn.Linear(4, 4)
        seen["here"] = (here.weight.device.type, here.weight.dtype, torch.tensor(0.5).dtype, torch.get_default_dtype())
        entered.set()
        assert done.wait(timeout=30)
    thread.join()
    return seen


def test_a_skeleton_in_bfloat16_leaves_another_threads_models_alone():
    seen = built_elsewhere(skeleton(), build_dtype.building_in(torch.bfloat16))
    assert seen["here"] == ("meta", torch.bfloat16, torch.bfloat16, torch.bfloat16)  # the skeleton: meta, bfloat16
    assert seen["device"] == "cpu" and seen["dtype"] == torch.float32  # the other thread: as if nothing happened
    assert seen["default"] == torch.float32 and seen["tensor"] == torch.float32
    assert (nn.Module.register_parameter, torch.get_default_dtype) == UNPATCHED  # unwrapped once nobody builds


def test_float32_made_on_purpose_stays_float32_and_what_takes_the_default_takes_the_build_dtype():
    with build_dtype.building_in(torch.bfloat16):
        made = {
            "empty": torch.empty(2), "tensor": torch.tensor([0.5]), "int tensor": torch.tensor([1]),
            "arange divided": torch.arange(4) / 4, "explicit": torch.zeros(2, dtype=torch.float32),
            "float()": torch.arange(4).float(), "ratio of floats": torch.ones(2, dtype=torch.float32) / 3,
        }
    assert {name: t.dtype for name, t in made.items()} == {
        "empty": torch.bfloat16, "tensor": torch.bfloat16, "int tensor": torch.int64, "arange divided": torch.bfloat16,
        "explicit": torch.float32, "float()": torch.float32, "ratio of floats": torch.float32,
    }
    assert torch.get_default_dtype() == torch.float32


def test_a_transformers_skeleton_matches_transformers_own_dtype_switch(tmp_path):
    import transformers

    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    config.save_pretrained(tmp_path)
    ours = build_skeleton(tmp_path, torch.bfloat16)
    with skeleton():
        theirs = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # switches the process
    assert torch.get_default_dtype() == torch.float32
    assert {n: p.dtype for n, p in ours.named_parameters()} == {n: p.dtype for n, p in theirs.named_parameters()}
    assert {n: (b.dtype, b.tolist()) for n, b in ours.named_buffers()} == {
        n: (b.dtype, b.tolist()) for n, b in theirs.named_buffers()}
    assert ours.config.dtype == torch.bfloat16


class _Rotary(nn.Module):
    """A large layer, a large buffer computed in `__init__`, and one made by `torch.empty` and filled there."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1024, 1024)  # 4 MiB of float32: allocated by `torch.empty`, then registered
        self.register_buffer("table", torch.arange(512 * 1024, dtype=torch.float32), persistent=False)  # 2 MiB
        self.register_buffer("filled", torch.empty(512 * 1024).fill_(1.0), persistent=False)


def test_a_skeletons_large_parameters_are_never_allocated_and_computed_buffers_stay_real(tmp_path):
    """A layer's `torch.empty` of a large parameter is made on meta (a real one, freed at once, left the C allocator's
    heap with holes the forwards then filled); buffers computed in `__init__` stay real, and one made large by
    `torch.empty` and filled there stays on meta, which a load refuses by name rather than compute with it."""
    import pytest
    import safetensors.torch

    import streamwise
    from streamwise.runtime.checkpoint.readers import CheckpointError

    with skeleton():
        model = _Rotary()
        small = torch.empty(16)
    assert model.proj.weight.is_meta and model.proj.bias.is_meta
    assert not model.table.is_meta and torch.equal(model.table[:3], torch.tensor([0.0, 1.0, 2.0]))
    assert model.filled.is_meta and not small.is_meta
    assert not torch.empty(1024, 1024).is_meta  # outside the skeleton: as ever
    safetensors.torch.save_file(_Rotary().state_dict(), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor `filled`: a non-persistent buffer on the meta device.*empty"):
        streamwise.load(model, tmp_path / "model.safetensors", "any-module")
