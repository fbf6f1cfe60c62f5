"""Text generation from a prepared prompt (`prompts`): the checkpoint's own generation settings with the caller's
choice of sampling, a long prompt's prefill in chunks, and the new tokens decoded.

End tokens, suppressed tokens and every other setting come from the checkpoint (`model.generation_config`, which
`load_pretrained` reads from its files); the caller chooses only how to pick each token: as the checkpoint says
(`"model default"`), the likeliest (`"greedy"`), or sampled with its own temperature, top-p and top-k (`"custom"`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from .errors import GenerationError
from .prompts import Prompt

SamplingMode = Literal["model default", "greedy", "custom"]
SAMPLING_MODES: tuple[SamplingMode, ...] = ("model default", "greedy", "custom")

# transformers' own defaults for the sampling-only flags: values its validator never calls "not valid" when greedy.
GREEDY_FLAGS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}

#: Tokens per forward of a long prompt's prefill, where the model's cache can resume one: its activations stay
#: those of this many tokens (a whole 32k-token prompt's MLP activations take gigabytes), and a host's interrupt is
#: checked between chunks. Large, since each chunk's forward fetches every streamed weight again.
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class Sampling:
    """How each new token is picked; `temperature`, `top_p` and `top_k` count under `"custom"` only."""

    mode: SamplingMode = "model default"
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50

    def __post_init__(self) -> None:
        if self.mode not in SAMPLING_MODES:
            raise GenerationError(f"sampling `{self.mode}` is not one of {', '.join(SAMPLING_MODES)}")


def generation_config(model, max_new_tokens: int, pad_token_id, sampling: Sampling = Sampling(),
                      prompt_length: int = 0, *, image: bool = False):
    """The model's own generation settings with `max_new_tokens`, the pad token and `sampling`; the prefill in
    chunks for a text prompt of `prompt_length` tokens where `prefill_chunk` says so (a prompt with an image is
    prefilled whole: the vision tower's features enter at its image tokens). Greedy sets the sampling-only flags
    neutral, so neither the caller's flags nor the checkpoint's generation_config.json log a warning."""
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                  prefill_chunk_size=None if image else prefill_chunk(model, prompt_length))
    if sampling.mode == "greedy":
        config.update(do_sample=False, **GREEDY_FLAGS)
    elif sampling.mode == "custom":
        config.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
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


def generate_text(model, prompt: Prompt, tokenizer, *, sampling: Sampling = Sampling(), seed: int = 0,
                  device: torch.device | str | None = None, stopping_criteria: Iterable = ()) -> str:
    """The text `model` generates for `prompt` (one of `prompts.prompts`), decoded by `tokenizer` without its
    special tokens. `seed` seeds sampling (torch's global generator, which transformers draws from); each of
    `stopping_criteria` runs once per new token (a host's progress bar and interrupt)."""
    import transformers

    inputs = {name: value.to(device or model.device) for name, value in prompt.inputs.items()}
    floating = {name: value.to(model.dtype) for name, value in inputs.items() if value.is_floating_point()}
    inputs.update(floating)  # pixel values in the model's dtype, as its processor's `.to(dtype)` would
    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    config = generation_config(model, prompt.max_new_tokens, pad, sampling, prompt.ids.shape[1], image=prompt.image)
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(**inputs, generation_config=config,
                                stopping_criteria=transformers.StoppingCriteriaList(list(stopping_criteria)))
    return tokenizer.decode(new_tokens(model, prompt.ids, output), skip_special_tokens=True)


def new_tokens(model, prompt_ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The tokens `generate` made: a causal model's output starts with the prompt, an encoder-decoder's does not."""
    if getattr(model.config, "is_encoder_decoder", False):
        return output[0]
    return output[0, prompt_ids.shape[1]:]
