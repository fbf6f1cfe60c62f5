"""Real ComfyUI core hosts a tree whose weights partly stay in their file (a host budget at load): core never
places or patches those modules, they read the file at each forward, and LoRA patches reach them as weight
functions. Run against an older core (no `offloadable`) and a newer one."""

from __future__ import annotations

import pytest
import torch

import streamwise
from streamwise.runtime.engine import file_tier

from helpers import tiny_qwen2

CPU, META = torch.device("cpu"), torch.device("meta")
IDS = torch.tensor([[3, 1, 4, 1, 5, 9]])
BUDGET = {"cpu": 64 << 10}  # a quarter of the tiny model: most blocks stay in the file


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2(tie_word_embeddings=False).save_pretrained(path)
    return path


def loaded(folder, **options):
    return streamwise.load_pretrained(folder, "auto", progress=False, **options).model


def generated(model) -> list[int]:
    with torch.no_grad():
        return model.generate(IDS, max_new_tokens=6, do_sample=False)[0].tolist()


def in_file(model) -> list[str]:
    return [path for path, module in model.named_modules() if file_tier.in_file(module)]


def test_core_loads_unloads_and_reloads_a_tree_reading_from_its_file(comfy_nodes, folder):
    expected = generated(loaded(folder))
    model = loaded(folder, max_memory=BUDGET)
    left = in_file(model)
    assert len(left) >= 4
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU)
    patcher.load(CPU, full_load=True)  # core would move every module and zero-fill a meta weight it loads whole
    assert in_file(model) == left and generated(model) == expected
    assert patcher.partially_unload(CPU, 10**9) >= 0
    assert generated(model) == expected
    patcher.partially_load(CPU, 30_000)
    assert generated(model) == expected
    patcher.detach()
    assert in_file(model) == left and generated(model) == expected


def test_placement_on_a_meta_device_leaves_the_file_tier_alone(comfy_nodes, folder):
    model = loaded(folder, max_memory=BUDGET)
    left = in_file(model)
    patcher = streamwise.model_patcher(model, load_device=META, offload_device=CPU)
    patcher.load(META, lowvram_model_memory=20_000)
    assert in_file(model) == left
    assert all(module.comfy_cast_weights for module in model.modules() if file_tier.in_file(module))
    assert model(IDS.to(META)).logits.is_meta  # read from the file, then moved to the compute device


def test_lora_patches_reach_weights_left_in_their_file(comfy_nodes, folder):
    key, diff = "model.layers.1.mlp.down_proj.weight", torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    reference = loaded(folder)
    with torch.no_grad():
        unpatched = reference(IDS).logits
        reference.get_parameter(key).add_(diff * 0.05)
        expected = reference(IDS).logits
    model = loaded(folder, max_memory=BUDGET)
    leaf = model.get_submodule(key.rsplit(".", 1)[0])
    assert file_tier.in_file(leaf)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU)
    assert patcher.add_patches({key: ("diff", (diff,))}, 0.05) == [key]
    patcher.load(CPU, full_load=True)
    with torch.no_grad():
        assert torch.allclose(model(IDS).logits, expected, atol=1e-5)
    assert file_tier.in_file(leaf)  # applied at each fetch, never merged into the file's placeholder
    patcher.unpatch_model(CPU)
    with torch.no_grad():
        assert torch.allclose(model(IDS).logits, unpatched, atol=1e-6)
