"""A folder `save_pretrained` wrote in the published layout (renamed keys, one tensor per expert) loads as
`from_pretrained` loads it: through transformers' own conversion, with the loader's checks on what comes out."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

import streamwise
from streamwise.runtime.checkpoint.readers import CheckpointError

transformers = pytest.importorskip("transformers")


def tiny_mixtral():
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                        num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def skeleton_of(model):
    with streamwise.skeleton():
        return type(model)(model.config).eval()


def test_experts_stored_one_by_one_load_stacked(tmp_path):
    model = tiny_mixtral()
    model.save_pretrained(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in stored  # the published layout
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    ids = torch.arange(12).reshape(2, 6)
    loaded = skeleton_of(model)
    report = streamwise.load(loaded, tmp_path, "transformers", progress=False)
    assert report.tensors == len(model.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_what_the_conversion_makes_is_checked_like_any_tensor(tmp_path):
    model = tiny_mixtral()
    model.save_pretrained(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del stored["model.layers.0.block_sparse_moe.experts.3.w2.weight"]  # one expert short
    stored["model.layers.0.stray.weight"] = torch.zeros(1)
    safetensors.torch.save_file(stored, tmp_path / "model.safetensors")
    loaded = skeleton_of(model)
    with pytest.raises(CheckpointError) as raised:
        streamwise.load(loaded, tmp_path, "transformers", progress=False)
    problems = "\n".join(raised.value.problems)
    assert "tensor `model.layers.0.mlp.experts.down_proj`: shape [3, 32, 64] in the file, [4, 32, 64]" in problems
    assert "tensor `model.layers.0.stray.weight`: not in the model (an extra tensor)" in problems
    assert all(p.is_meta for p in loaded.parameters())  # untouched
