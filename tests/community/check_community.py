"""Runs inside a separate environment with the community `vibevoice` package (transformers 4.51.3).

Prints one JSON object for tests/convert/test_community_vibevoice.py: the shipped policy's plan for the
full-size community model on meta, and parity checks of streamed community modules on CPU.
"""

from __future__ import annotations

import copy
import json
import logging

import torch
from accelerate import init_empty_weights

logging.disable(logging.WARNING)  # the package logs about APEX on import

from vibevoice.modular import modular_vibevoice_diffusion_head as head  # noqa: E402
from vibevoice.modular import modular_vibevoice_tokenizer as tokenizer  # noqa: E402
from vibevoice.modular.configuration_vibevoice import VibeVoiceAcousticTokenizerConfig, VibeVoiceConfig  # noqa: E402
from vibevoice.modular.modeling_vibevoice_inference import VibeVoiceForConditionalGenerationInference  # noqa: E402

import streamwise  # noqa: E402

POLICY = streamwise.load_policy("vibevoice")


def rules_optional(policy):
    """The shipped policy applied to a fragment of the model: every rule may match nothing."""
    sections = {
        name: getattr(policy, name).model_copy(
            update={"rule": tuple(rule.model_copy(update={"optional": True}) for rule in getattr(policy, name).rule)}
        )
        for name in ("stream", "relocate", "quant")
    }
    return policy.model_copy(update=sections)


def streamed_copy(module: torch.nn.Module, policy=POLICY) -> torch.nn.Module:
    converted = copy.deepcopy(module)
    report = streamwise.offload(converted, policy, device="cpu", budget=0)
    assert report.resident_modules == 0
    return converted


def norm_parity() -> dict[str, bool]:
    cases = {
        "tokenizer.RMSNorm": (tokenizer.RMSNorm(8), torch.randn(2, 5, 8)),
        "diffusion_head.RMSNorm": (head.RMSNorm(8), torch.randn(2, 5, 8)),
        "ConvRMSNorm": (tokenizer.ConvRMSNorm(8), torch.randn(2, 8, 5)),
        "ConvLayerNorm": (tokenizer.ConvLayerNorm(8), torch.randn(2, 8, 5)),
    }
    results = {}
    for name, (norm, x) in cases.items():
        with torch.no_grad():
            for parameter in norm.parameters():
                parameter.copy_(torch.randn_like(parameter))
        container = torch.nn.Sequential(norm)
        converted = streamed_copy(container, rules_optional(POLICY))
        for dtype in (torch.float32, torch.bfloat16):
            results[f"{name}/{dtype}"] = torch.equal(container(x.to(dtype)), converted(x.to(dtype)))
    return results


def tokenizer_round_trip(layernorm: str) -> bool:
    config = VibeVoiceAcousticTokenizerConfig(
        vae_dim=8, encoder_n_filters=4, encoder_ratios=[2, 2], encoder_depths="1-1-1", layernorm=layernorm,
        layer_scale_init_value=0.5, fix_std=0.5,
    )
    torch.manual_seed(0)
    original = tokenizer.VibeVoiceAcousticTokenizerModel(config).eval()
    converted = streamed_copy(original, rules_optional(POLICY))
    audio = torch.randn(1, 1, 64)
    with torch.no_grad():
        latents = original.encode(audio).mean
        same_latents = torch.equal(converted.encode(audio).mean, latents)
        same_audio = torch.equal(converted.decode(latents), original.decode(latents))
    return same_latents and same_audio


def full_size_plan() -> dict:
    # The package calls .item() while building, so only parameters can go to meta (as accelerate does).
    with init_empty_weights():
        model = VibeVoiceForConditionalGenerationInference(VibeVoiceConfig())
    plan = streamwise.resolve(POLICY, model)
    summary = plan.summary()
    summary["complete"] = plan.coverage.complete
    return summary


if __name__ == "__main__":
    print(json.dumps({
        "plan": full_size_plan(),
        "norm_parity": norm_parity(),
        "tokenizer_round_trip": {name: tokenizer_round_trip(name) for name in ("RMSNorm", "LN")},
    }, indent=2))
