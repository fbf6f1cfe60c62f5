"""Real models give identical outputs before and after conversion, resident or streamed."""

from __future__ import annotations

import copy

import pytest
import torch

import streamwise

from helpers import force_streaming, tiny_acoustic_tokenizer, tiny_qwen2


def generate(model, ids):
    return model.generate(ids, max_new_tokens=8, do_sample=False)


@pytest.fixture(scope="module")
def qwen_and_reference():
    torch.manual_seed(0)
    model = tiny_qwen2(tie_word_embeddings=True)
    ids = torch.randint(0, 128, (2, 5))
    return model, ids, generate(model, ids)


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_qwen2_generate_is_identical_after_conversion(qwen_and_reference, mode):
    original, ids, expected = qwen_and_reference
    model = copy.deepcopy(original)
    streamwise.apply(streamwise.resolve(streamwise.load_policy("decoder-llm"), model), model)
    force_streaming(model, mode == "streamed")
    assert torch.equal(generate(model, ids), expected)


def test_qwen2_generate_is_identical_under_the_standalone_host(qwen_and_reference):
    original, ids, expected = qwen_and_reference
    model = copy.deepcopy(original)
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=60_000)
    assert report.resident_modules > 0 and report.streamed_modules > 0
    assert report.resident_bytes <= 60_000
    assert torch.equal(generate(model, ids), expected)
    streamed = [m for m in model.modules() if getattr(m, "comfy_cast_weights", False)]
    assert len(streamed) == report.streamed_modules


def test_vibevoice_acoustic_tokenizer_round_trip_is_identical():
    torch.manual_seed(0)
    original = tiny_acoustic_tokenizer()
    audio = torch.randn(1, 1, 96)
    with torch.no_grad():
        latents = original.encode(audio, sample=False).latents
        decoded = original.decode(latents).audio
    model = copy.deepcopy(original)
    report = streamwise.offload(model, "vibevoice", device="cpu", budget=0)
    assert report.resident_modules == 0 and report.streamed_bytes > 0
    with torch.no_grad():
        assert torch.equal(model.encode(audio, sample=False).latents, latents)
        assert torch.equal(model.decode(latents).audio, decoded)


def test_budget_none_keeps_everything_resident():
    model = tiny_qwen2()
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=None)
    assert report.budget is None and report.streamed_modules == 0 and report.streamed_bytes == 0
    assert not any(getattr(m, "comfy_cast_weights", False) for m in model.modules())


def test_offload_refuses_a_policy_that_does_not_fit():
    with pytest.raises(streamwise.PolicyError, match="unmatched-rule"):
        streamwise.offload(tiny_acoustic_tokenizer(), "decoder-llm", device="cpu", budget=0)


def test_tied_weights_stream_or_stay_together():
    model = tiny_qwen2(tie_word_embeddings=True)
    embedding_bytes = 128 * 64 * 4
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=embedding_bytes - 1)
    assert model.model.embed_tokens.comfy_cast_weights and model.lm_head.comfy_cast_weights
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() counts tied ones once
    assert report.resident_bytes + report.streamed_bytes == unique  # every parameter belongs to a streamed leaf
