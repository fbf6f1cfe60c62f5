"""Text generation: a model's own generation defaults with the caller's flags, and prompts checked against the
model before any forward (bounded in characters and in tokens by its context)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch

from ...errors import Error

# transformers' own defaults for the sampling-only flags: values its validator never calls "not valid" when greedy.
GREEDY_FLAGS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}


#: Tokens per forward of a long prompt's prefill, where the model's cache can resume one: its activations stay
#: those of this many tokens (a whole 32k-token prompt's MLP activations take gigabytes), and a host's interrupt is
#: checked between chunks. Large, since each chunk's forward fetches every streamed weight again.
PREFILL_CHUNK = 2048


def generation_config(model, max_new_tokens: int, do_sample: bool, pad_token_id, prompt_length: int = 0,
                      **sampling):
    """The model's own generation defaults with these flags, and the prefill in chunks for a prompt of
    `prompt_length` tokens where `prefill_chunk` says so. Sampling flags apply only when sampling; a greedy run sets
    them neutral, so neither the caller's flags nor the checkpoint's generation_config.json log a warning."""
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad_token_id,
                  prefill_chunk_size=prefill_chunk(model, prompt_length), **(sampling if do_sample else GREEDY_FLAGS))
    return config


def prefill_chunk(model, prompt_length: int) -> int | None:
    """`PREFILL_CHUNK` for a prompt longer than it, on a causal model whose cache has attention layers to resume
    from; None (one forward) otherwise: an encoder-decoder's encoder takes its input whole, and a recurrent state
    (Mamba, RWKV) has no length to continue at."""
    if prompt_length <= PREFILL_CHUNK or getattr(model.config, "is_encoder_decoder", False):
        return None
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return None
    import transformers

    try:
        transformers.DynamicCache(config=model.config.get_text_config(decoder=True)).get_seq_length()
    except (ValueError, TypeError, AttributeError):  # no attention layer (its error), or an older transformers
        return None
    return PREFILL_CHUNK


_NOT_TEXT = re.compile("[\0\ud800-\udfff]")
#: Positions assumed for a model that states no limit (T5's relative buckets) and whose tokenizer states none.
DEFAULT_CONTEXT = 4096
#: Characters a prompt may hold per position of the context, checked before tokenizing (no tokenizer's tokens are
#: that long on average; a bound the tokenizer's own time and memory stay within).
CHARACTERS_PER_POSITION = 32


class PromptError(Error, ValueError):
    """A prompt the model cannot take: what is wrong, with the numbers, and what to do."""


@dataclass(frozen=True)
class PromptFit:
    """A checked prompt: its token ids, the new tokens it leaves room for, and a note when that had to be less."""

    ids: torch.Tensor
    max_new_tokens: int
    note: str | None = None


def context_of(model, tokenizer) -> tuple[int, str]:
    """The positions `model` can attend over, and where that figure comes from."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    # a vision-language model's limit is its text decoder's
    parts = [(config, "")] if text is config else [(text, "text_config."), (config, "")]
    for part, prefix in parts:
        for name in ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx"):
            value = getattr(part, name, None)
            if isinstance(value, int) and value > 0:
                return value, f"its config's `{prefix}{name}`"
    stated = getattr(tokenizer, "model_max_length", None)
    if isinstance(stated, int) and 0 < stated < 10**8:  # transformers writes "no limit" as a huge number
        return stated, "its tokenizer's `model_max_length`"
    return DEFAULT_CONTEXT, f"no limit stated by the model or its tokenizer: Streamwise's default of {DEFAULT_CONTEXT}"


def fit_prompt(prompt: str, tokenizer, model, max_new_tokens: int, what: str = "prompt") -> PromptFit:
    """`prompt` tokenized for `model`, checked before any forward: text a tokenizer takes (no lone surrogate or NUL),
    a length in characters bounded before tokenizing, and tokens that fit the context; `max_new_tokens` is clipped
    to the room left, with a note. Raises `PromptError` naming the input (`what`) and the numbers."""
    context, source = context_of(model, tokenizer)
    if len(prompt) > CHARACTERS_PER_POSITION * context:
        raise PromptError(f"{what}: {len(prompt)} characters, more than {CHARACTERS_PER_POSITION * context} "
                          f"({CHARACTERS_PER_POSITION} per position of the model's context of {context}, {source}); "
                          f"shorten it")
    bad = _NOT_TEXT.search(prompt)
    if bad is not None:
        character = bad.group()
        kind = "a NUL character" if character == "\0" else f"a lone surrogate (U+{ord(character):04X})"
        raise PromptError(f"{what}: holds {kind} at character {bad.start() + 1}, which is not text a tokenizer "
                          f"takes; remove it (a lone surrogate often comes from text cut inside an emoji)")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise PromptError(f"{what}: tokenizes to no tokens; write a prompt to continue")
    decoder = getattr(model.config, "is_encoder_decoder", False)  # its output has positions of its own
    room = context if decoder else context - ids.shape[1]
    if ids.shape[1] > context or room < 1:
        raise PromptError(f"{what}: {ids.shape[1]} tokens, and the model's context is {context} positions "
                          f"({source}): no room for a new token; shorten the prompt")
    if max_new_tokens <= room:
        return PromptFit(ids, max_new_tokens)
    return PromptFit(ids, room, f"max_new_tokens clipped from {max_new_tokens} to {room}: the model's context is "
                                f"{context} positions ({source})" + ("" if decoder else
                                                                     f" and the prompt takes {ids.shape[1]}"))


def new_tokens(model, prompt_ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The tokens `generate` made: a causal model's output starts with the prompt, an encoder-decoder's does not."""
    if getattr(model.config, "is_encoder_decoder", False):
        return output[0]
    return output[0, prompt_ids.shape[1]:]
