"""Prompts checked against the model before any forward, the new tokens of causal and encoder-decoder models, and
an interrupt honoured inside a forward (before each block)."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from streamwise.runtime.generation import (
    PromptError,
    Sampling,
    generation_config,
    interrupt_at_blocks,
    new_tokens,
    prompts,
)
from streamwise.runtime.generation import text as text_module
from streamwise.runtime.generation.prompts import CHARACTERS_PER_POSITION, DEFAULT_CONTEXT
from streamwise.runtime.generation.text import prefill_chunk

from helpers import tiny_llava, tiny_qwen2, tiny_t5, tiny_tokenizer


def fit_prompt(prompt: str, tokenizer, model, max_new_tokens: int):
    """The one prompt `prompts` makes of `prompt` continued as it is (chat off)."""
    (given,) = prompts(model, tokenizer, prompt, max_new_tokens, chat=False)
    return given


class Counted:
    """A tokenizer that counts its calls, so a test sees a refusal came before tokenizing."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls, self.model_max_length = tokenizer, 0, tokenizer.model_max_length

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)


def test_text_a_tokenizer_cannot_take_is_refused_naming_the_input_and_the_place():
    tokenizer = Counted(tiny_tokenizer())
    for prompt, what in (("a cat \ud83d sat", "a lone surrogate (U+D83D) at character 7"),
                         ("a\0cat", "a NUL character at character 2")):
        with pytest.raises(PromptError, match="^prompt: holds " + re.escape(what)):
            fit_prompt(prompt, tokenizer, tiny_qwen2(), 8)
    assert tokenizer.calls == 0


def test_a_prompt_past_the_context_is_refused_before_tokenizing_or_any_forward_with_both_numbers():
    model, tokenizer = tiny_qwen2(max_position_embeddings=16), Counted(tiny_tokenizer())
    with pytest.raises(PromptError, match=rf"{16 * CHARACTERS_PER_POSITION + 1} characters, more than "
                                          rf"{16 * CHARACTERS_PER_POSITION} .*context of 16"):
        fit_prompt("x" * (16 * CHARACTERS_PER_POSITION + 1), tokenizer, model, 4)
    assert tokenizer.calls == 0  # bounded before the tokenizer sees it
    with pytest.raises(PromptError, match=r"^prompt: \d+ tokens, and the model's context is 16 positions "
                                          r"\(its config's `max_position_embeddings`\)"):
        fit_prompt("a cat sat " * 20, tokenizer, model, 4)


def test_a_prompt_filling_the_whole_context_leaves_no_room_and_is_refused():
    tokenizer = tiny_tokenizer()
    filling = len(tokenizer("a cat sat on the mat").input_ids)
    with pytest.raises(PromptError, match=rf"^prompt: {filling} tokens, .* context is {filling} positions .*no room"):
        fit_prompt("a cat sat on the mat", tokenizer, tiny_qwen2(max_position_embeddings=filling), 4)
    assert fit_prompt("a cat sat on the mat", tokenizer, tiny_qwen2(max_position_embeddings=filling + 1),
                      4).max_new_tokens == 1


def test_max_new_tokens_past_the_context_is_clipped_with_a_note():
    model, tokenizer = tiny_qwen2(max_position_embeddings=32), tiny_tokenizer()
    fit = fit_prompt("a cat sat", tokenizer, model, 8192)
    prompt_tokens = fit.ids.shape[1]
    assert fit.max_new_tokens == 32 - prompt_tokens
    assert fit.note == (f"max_new_tokens clipped from 8192 to {32 - prompt_tokens}: the model's context is 32 "
                        f"positions (its config's `max_position_embeddings`) and the prompt takes {prompt_tokens}")
    assert fit_prompt("a cat sat", tokenizer, model, 4).note is None


def test_a_model_stating_no_limit_takes_its_tokenizers_or_the_default():
    model, tokenizer = tiny_t5(), tiny_tokenizer()  # T5: relative position buckets, no limit in its config
    tokenizer.model_max_length = 24
    assert fit_prompt("a cat", tokenizer, model, 100).max_new_tokens == 24  # an encoder-decoder's output: 24 new
    tokenizer.model_max_length = int(1e30)  # transformers' "no limit"
    assert fit_prompt("a cat", tokenizer, model, 10**6).max_new_tokens == DEFAULT_CONTEXT


def test_a_vision_language_models_context_is_its_text_decoders():
    fit = fit_prompt("a cat sat", tiny_tokenizer(), tiny_llava(max_position_embeddings=16), 8192)
    assert "16 positions (its config's `text_config.max_position_embeddings`)" in fit.note


@pytest.mark.parametrize("build", [tiny_qwen2, tiny_t5, tiny_llava],
                         ids=["causal", "encoder-decoder", "vision-language"])
def test_new_tokens_are_what_generate_made_for_causal_and_encoder_decoder_models(build):
    torch.manual_seed(0)
    model, tokenizer = build(), tiny_tokenizer()
    ids = fit_prompt("a cat sat on the mat and then a dog came by " * 3, tokenizer, model, 5).ids
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    made = new_tokens(model, ids, output)
    if build is tiny_t5:  # the decoder's output alone, started from its start token: none of it is the prompt
        assert torch.equal(made, output[0]) and len(made) <= 6 and ids.shape[1] > 6
    else:
        assert torch.equal(made, output[0, ids.shape[1]:]) and len(made) == 5


def test_an_interrupt_is_honoured_before_each_block_of_a_forward():
    model = tiny_qwen2(num_hidden_layers=4)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 4:
            raise InterruptedError("interrupted")

    with pytest.raises(InterruptedError), interrupt_at_blocks(model, check) as blocks:
        model(torch.tensor([[3, 1, 4, 1, 5]]))  # one prefill: checked before it, stopped before its third block
    assert blocks == 4 and len(calls) == 4
    assert not any(m._forward_pre_hooks for m in model.modules())  # the hooks are gone after


def test_a_long_prompt_is_prefilled_in_chunks_giving_the_same_tokens_with_an_interrupt_between_them(monkeypatch):
    """Past `PREFILL_CHUNK` tokens a causal model's prefill runs chunk by chunk (bounded activations), with the
    tokens one forward gives; a host's interrupt is checked before each chunk, even in a model naming no blocks."""
    monkeypatch.setattr(text_module, "PREFILL_CHUNK", 8)
    torch.manual_seed(0)
    model = tiny_qwen2()
    ids = torch.randint(3, 120, (1, 30))
    greedy = Sampling("greedy")
    config = generation_config(model, 5, 0, greedy, prompt_length=ids.shape[1])
    assert config.prefill_chunk_size == 8
    assert generation_config(model, 5, 0, greedy, prompt_length=8).prefill_chunk_size is None  # one chunk: whole
    assert generation_config(model, 5, 0, greedy, ids.shape[1], image=True).prefill_chunk_size is None
    lengths = []
    model.register_forward_hook(lambda module, args, kwargs, output: lengths.append(kwargs["input_ids"].shape[1]),
                                with_kwargs=True)  # forwards that ran to their end
    with torch.no_grad():
        chunked = model.generate(ids, generation_config=config)
        assert lengths[:4] == [8, 8, 8, 6] and len(lengths) == 8  # the prefill in 4 chunks, then 4 new tokens
        assert torch.equal(chunked, model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0))
    model._no_split_modules, calls = None, []

    def check() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise InterruptedError("interrupted")

    lengths.clear()
    with pytest.raises(InterruptedError), torch.no_grad(), interrupt_at_blocks(model, check) as blocks:
        model.generate(ids, generation_config=config)
    assert blocks == 0 and lengths == [8]  # stopped before the second chunk


def test_a_prefill_is_whole_where_no_chunk_can_resume_it():
    """An encoder-decoder's encoder takes its input whole; a recurrent state (Mamba) has no length to continue at."""
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=64, num_hidden_layers=2,
                                                                   vocab_size=128, state_size=8))
    assert prefill_chunk(tiny_qwen2(), 10_000) == text_module.PREFILL_CHUNK
    assert prefill_chunk(tiny_t5(), 10_000) is None and prefill_chunk(mamba, 10_000) is None
