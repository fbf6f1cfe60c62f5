"""A specific kind can never change the numbers: look-alike classes under every shipped policy.

A property test: a random look-alike (the short name of a class a shipped policy selects with a specific kind,
perturbed math: a term for one input rank only, a per-instance parameter that is 1.0 on the first module only, `eps`
outside the square root, Gemma's `1 + w`) is swapped into a real tiny model, which each shipped policy converts.
Each case is either refused with an error that says where, or gives at budget 0 (every leaf fetching) exactly
what it gives fully resident, which is exactly what the unconverted tree gives.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamwise
from streamwise.runtime.convert import ConversionError
from streamwise.runtime.policy.folders import SHIPPED_POLICY_DIR, list_policies

from helpers import tiny_acoustic_tokenizer, tiny_qwen2
from look_alikes import BASES, make, swap_in

SHIPPED = sorted(list_policies([SHIPPED_POLICY_DIR]))
# The short names shipped policies select with a specific kind, the base computation each stands for, and the host
# tree that holds modules of that name.
NAMES = {
    "Linear": ("linear", "qwen2"),
    "Qwen2RMSNorm": ("rms_norm", "qwen2"),
    "Embedding": ("embedding", "qwen2"),
    "Conv1d": ("conv1d", "tokenizer"),
    "VibeVoiceAcousticTokenizerRMSNorm": ("rms_norm", "tokenizer"),
}


def _host(name: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    if name == "qwen2":
        return tiny_qwen2(num_hidden_layers=2), {"input_ids": torch.tensor([[1, 5, 9, 3, 7]])}
    return tiny_acoustic_tokenizer(), {"input_values": torch.randn(1, 1, 32)}


def _output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    torch.manual_seed(1)  # the tokenizer samples its latents
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.audio


# Policies that fit any tree: a look-alike under them is never a reason to refuse.
FIT_ANY = {"any-module", "transformers"}


@pytest.mark.parametrize("policy", SHIPPED)
@pytest.mark.parametrize("name", sorted(NAMES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_look_alike_is_refused_where_it_says_or_computes_the_same_at_every_budget(name, policy, data):
    base, host = NAMES[name]
    perturbation = data.draw(st.sampled_from(BASES[base]), label="perturbation")
    rank = data.draw(st.integers(2, 3), label="rank")
    model, inputs = _host(host)
    assert swap_in(model, make(name, base, perturbation, rank), base, perturbation,
                   seed=data.draw(st.integers(0, 2**16), label="seed")) > 0
    expected = _output(model, inputs)
    resident, streamed = copy.deepcopy(model), copy.deepcopy(model)
    try:
        streamwise.offload(resident, policy, device="cpu", budget=None)
        streamwise.offload(streamed, policy, device="cpu", budget=0)
    except (streamwise.PolicyError, ConversionError) as refused:
        assert policy not in FIT_ANY, f"{policy} refused a look-alike {name} ({perturbation}): {refused}"
        text = str(refused)
        assert "rule `" in text or "module" in text, text  # it says which rule or module
        return
    assert torch.equal(_output(resident, inputs), expected)
    assert torch.equal(_output(streamed, inputs), expected), (name, perturbation, rank, policy)
