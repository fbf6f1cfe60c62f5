"""`auto`: a policy picked by root class, then model_type, then state-dict key patterns; never by a guess."""

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


def test_nothing_recognized_is_an_error_not_a_guess():
    with pytest.raises(PolicyError, match="no policy's \\[match\\] recognizes `Unknown`"):
        select_policy(Unknown(), keys=["encoder.weight"])
