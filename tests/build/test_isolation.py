"""Building a skeleton changes nothing for the rest of the process: another thread meanwhile builds ordinary models
(real parameters, torch's default dtype), and the default dtype itself never changes."""

from __future__ import annotations

import contextlib
import importlib
import threading

import torch
from torch import nn

from streamwise.runtime.build.skeleton import build_skeleton, skeleton

build_dtype = importlib.import_module("streamwise.runtime.build.build_dtype")
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
