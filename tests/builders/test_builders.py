"""Builders: a Hugging Face folder becomes a skeleton in the requested dtype, as transformers builds it."""

from __future__ import annotations

import torch
import transformers

from streamwise.runtime.builders.skeleton import build_skeleton


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


def test_a_builder_a_node_pack_registers_on_the_package_face_builds_its_folder(tmp_path, monkeypatch):
    """`streamwise.register_builder`: a folder without `config.json` (a pack's own format) is built by the pack's
    builder, on `meta` inside `streamwise.skeleton()`, and loaded with its weights like any other."""
    import json

    import safetensors.torch

    import streamwise
    from streamwise.runtime.builders.skeleton import BUILDERS

    monkeypatch.setattr(BUILDERS, "_entries", dict(BUILDERS._entries))  # this test's only

    def voice_pack(folder, dtype):
        spec = folder / "voice.json"
        if not spec.is_file():
            return None
        width = json.loads(spec.read_text())["width"]
        with streamwise.skeleton():
            return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 2))

    assert streamwise.register_builder(voice_pack) is voice_pack
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    (tmp_path / "voice.json").write_text(json.dumps({"width": 16}))
    safetensors.torch.save_file(reference.state_dict(), tmp_path / "model.safetensors")
    assert all(p.is_meta for p in build_skeleton(tmp_path).parameters())
    loaded = streamwise.load_pretrained(tmp_path, "auto", progress=False).model
    x = torch.randn(3, 16)
    assert torch.equal(loaded(x), reference(x))
