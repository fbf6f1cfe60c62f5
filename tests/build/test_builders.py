"""Builders: a Hugging Face folder becomes a skeleton in the requested dtype, as transformers builds it."""

from __future__ import annotations

import torch
import transformers

from streamwise.runtime.build.skeleton import build_skeleton


def test_a_bf16_skeleton_keeps_float32_rotary_tables(tmp_path):
    transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ).save_pretrained(tmp_path)
    model = build_skeleton(tmp_path, torch.bfloat16)
    reference = build_skeleton(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.is_meta for p in model.parameters())
    inv_freq = dict(model.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, dict(reference.named_buffers())["model.rotary_emb.inv_freq"])
    assert torch.get_default_dtype() == torch.float32
