"""The round trip people make: `save_pretrained`, then `load_pretrained` of that folder, streamed at budget 0, computes
exactly what the model in memory computes, for families no shipped policy names (encoder-decoder, vision-language,
mixture of experts, state-space and hybrid, audio) and diffusers' transformer, UNet and VAE. The class built is the
one the folder's config names.

`auto` picks the policy from the files as it does from the model in memory, and plans both alike.
"""

from __future__ import annotations

import json

import pytest
import torch

import streamwise
from streamwise.runtime.convert import applied_state
from streamwise.runtime.plan.auto import select_policy

from helpers import DIFFUSERS_SAMPLE, tiny_diffusers, tiny_sample, tiny_vision_language

transformers = pytest.importorskip("transformers")
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=64)


def _ids() -> dict:
    return {"input_ids": torch.randint(0, 64, (2, 6))}


def tiny_family(name: str):
    """(model, inputs, its output's attribute) of one family, from seed 0."""
    T = transformers
    if name in ("encoder-decoder", "moe", "state-space", "audio"):
        return (*tiny_sample(name), "logits")
    torch.manual_seed(0)
    if name == "vision-language":
        return (*tiny_vision_language(), "logits")
    if name == "llava":
        vision = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16)
        config = T.LlavaConfig(text_config=dict(model_type="llama", **_TEXT), vision_config=vision)
        return T.LlavaForConditionalGeneration(config), _ids(), "logits"
    if name == "mixtral":
        config = T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_TEXT)
        return T.MixtralForCausalLM(config), _ids(), "logits"
    if name == "olmoe":
        return T.OlmoeForCausalLM(T.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **_TEXT)), _ids(), "logits"
    if name == "hybrid":
        config = T.BambaConfig(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                               mamba_n_groups=1, mamba_chunk_size=8, **_TEXT)
        return T.BambaForCausalLM(config), _ids(), "logits"
    if name == "bart":
        config = T.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                              max_position_embeddings=64)
        return T.BartForConditionalGeneration(config), _ids(), "logits"
    return (*tiny_diffusers(name), "sample")


TRANSFORMERS_FAMILIES = ["encoder-decoder", "bart", "vision-language", "llava", "moe", "mixtral", "olmoe",
                         "state-space", "hybrid", "audio"]


@pytest.mark.parametrize("name", TRANSFORMERS_FAMILIES + DIFFUSERS_SAMPLE)
def test_a_saved_folder_loads_the_class_it_names_and_streams_to_what_the_model_computes(tmp_path, name):
    model, inputs, output = tiny_family(name)
    model.eval().save_pretrained(tmp_path)
    with torch.no_grad():
        expected = getattr(model(**inputs), output)
    config = json.loads((tmp_path / "config.json").read_text())
    diffusers = "_class_name" in config
    in_memory = select_policy(model)
    loaded, report, chosen = streamwise.load_pretrained(tmp_path, "auto", progress=False)
    named = config["_class_name"] if diffusers else config["architectures"][0]
    assert named == type(model).__name__ and isinstance(loaded, type(model))
    assert report.built == f"{named} ({'diffusers `_class_name`' if diffusers else 'config.architectures'})"
    policy = applied_state(loaded).plan.policy
    assert chosen == in_memory.reason and policy == in_memory.policy.name == ("any-module" if diffusers
                                                                               else "transformers")
    assert applied_state(loaded).plan.modules == in_memory.resolved[0].modules  # the same plan by either route
    placed = streamwise.offload(loaded, policy, device="cpu", budget=0)
    assert placed.resident_modules == 0 and placed.streamed_modules > 0
    with torch.no_grad():
        assert torch.equal(getattr(loaded(**inputs), output), expected)


def test_a_safetensors_model_loads_without_importing_the_gguf_package(tmp_path):
    """The gguf package (20 ms, a sixth of Streamwise's imports) is imported only where a GGUF file or resident is in
    play: a safetensors load is every user's first forward, timed against transformers' (#33)."""
    import subprocess
    import sys
    import textwrap

    model, _, _ = tiny_family("mixtral")
    model.save_pretrained(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        import streamwise
        model, _, _ = streamwise.load_pretrained({str(tmp_path)!r}, "auto", progress=False)
        gguf = [name for name in sys.modules
                if name.split(".")[0] == "gguf" or name.startswith("streamwise") and "gguf" in name]
        print(sorted(gguf), type(model).__name__)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "MixtralForCausalLM"]
