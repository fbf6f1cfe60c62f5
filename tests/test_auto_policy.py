"""`auto`: a policy picked by root class, then model_type, state-dict key patterns, base class, then the fallback;
equal matches are an error, never a guess."""

from __future__ import annotations

import pytest
import torch

from streamwise import PolicyError
from streamwise.runtime.plan.auto import select_policy


class Unknown(torch.nn.Module):
    pass


def test_key_patterns_pick_a_policy_when_class_and_model_type_do_not():
    keys = ["model.acoustic_tokenizer.encoder.stem.weight", "model.language_model.embed_tokens.weight"]
    policy, reason = select_policy(Unknown(), keys=keys)
    assert (policy.name, reason) == ("vibevoice", "`auto` picked `vibevoice` by its state-dict key patterns")


def test_a_family_policy_beats_the_library_policy_which_beats_the_fallback(tmp_path):
    import transformers

    from helpers import tiny_qwen2

    assert select_policy(tiny_qwen2())[0].name == "decoder-llm"  # by root class
    config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64, head_dim=16)
    policy, reason = select_policy(transformers.Qwen3ForCausalLM(config))
    assert (policy.name, reason) == ("transformers", "`auto` picked `transformers` by base class `PreTrainedModel`, "
                                                     "no family policy")
    policy, reason = select_policy(Unknown(), keys=["encoder.weight"])
    assert (policy.name, reason) == ("any-module", "`auto` picked `any-module` by fallback: no other policy "
                                                   "recognizes it")


def test_two_fallbacks_are_an_error_not_a_guess(tmp_path):
    (tmp_path / "mine.toml").write_text('schema_version = 1\n[policy]\nname = "mine"\n[match]\nfallback = true\n')
    with pytest.raises(PolicyError, match="policies `any-module`, `mine` all match `Unknown` by fallback"):
        select_policy(Unknown(), dirs=[tmp_path])
