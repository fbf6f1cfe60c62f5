"""What a text model is given: the prompt framed as its checkpoint frames a conversation (the chat template, with a
system turn and the prompt as the user's), images through the model's own processor, and all of it checked against
the model before any forward: text a tokenizer takes, bounded in characters before tokenizing and in tokens by the
model's context.

A model whose tokenizer (or processor) has no chat template continues the prompt as it is, as does any model with
`chat=False`. Images go only to a model that takes them, one prompt per image, so each image gets its own text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .errors import GenerationError

_NOT_TEXT = re.compile("[\0\ud800-\udfff]")
#: Positions assumed for a model that states no limit (T5's relative buckets) and whose tokenizer states none.
DEFAULT_CONTEXT = 4096
#: Characters a prompt may hold per position of the context, checked before tokenizing (no tokenizer's tokens are
#: that long on average; a bound the tokenizer's own time and memory stay within).
CHARACTERS_PER_POSITION = 32


class PromptError(GenerationError):
    """A prompt the model cannot take: what is wrong, with the numbers, and what to do."""


@dataclass(frozen=True)
class Prompt:
    """One generation's input: what the model's forward takes (`input_ids`, and `pixel_values` and the like for an
    image), the new tokens it leaves room for, a note when that had to be less, and how it was framed."""

    inputs: dict[str, torch.Tensor]
    max_new_tokens: int
    note: str | None
    chat: bool
    """Framed by the model's chat template."""
    image: bool = False
    """Holds an image's values (prefilled whole: the vision tower's features enter at its image tokens)."""

    @property
    def ids(self) -> torch.Tensor:
        return self.inputs["input_ids"]


def takes_images(model: nn.Module) -> bool:
    """Whether `model` is a vision-language model: a class transformers maps for image-and-text to text."""
    from transformers.models.auto import modeling_auto

    mappings = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES")
    return any(type(model).__name__ in (value if isinstance(value, (list, tuple)) else (value,))
               for mapping in mappings for value in getattr(modeling_auto, mapping, {}).values())


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


def check_text(text: str, what: str, context: tuple[int, str]) -> None:
    """Refuse text no tokenizer should see (a lone surrogate, a NUL) or longer than the context can hold, before
    tokenizing; `what` names the input."""
    positions, source = context
    if len(text) > CHARACTERS_PER_POSITION * positions:
        raise PromptError(f"{what}: {len(text)} characters, more than {CHARACTERS_PER_POSITION * positions} "
                          f"({CHARACTERS_PER_POSITION} per position of the model's context of {positions}, {source}); "
                          f"shorten it")
    bad = _NOT_TEXT.search(text)
    if bad is not None:
        character = bad.group()
        kind = "a NUL character" if character == "\0" else f"a lone surrogate (U+{ord(character):04X})"
        raise PromptError(f"{what}: holds {kind} at character {bad.start() + 1}, which is not text a tokenizer "
                          f"takes; remove it (a lone surrogate often comes from text cut inside an emoji)")


def fit_ids(ids: torch.Tensor, model, context: tuple[int, str], max_new_tokens: int,
            what: str = "prompt") -> tuple[int, str | None]:
    """The new tokens `ids` leave room for within the context, and a note where that is fewer than `max_new_tokens`;
    a PromptError where there is no room at all."""
    positions, source = context
    if ids.shape[1] == 0:
        raise PromptError(f"{what}: tokenizes to no tokens; write a prompt to continue")
    decoder = getattr(model.config, "is_encoder_decoder", False)  # its output has positions of its own
    room = positions if decoder else positions - ids.shape[1]
    if ids.shape[1] > positions or room < 1:
        raise PromptError(f"{what}: {ids.shape[1]} tokens, and the model's context is {positions} positions "
                          f"({source}): no room for a new token; shorten the prompt")
    if max_new_tokens <= room:
        return max_new_tokens, None
    return room, (f"max_new_tokens clipped from {max_new_tokens} to {room}: the model's context is {positions} "
                  f"positions ({source})" + ("" if decoder else f" and the prompt takes {ids.shape[1]}"))


def prompts(model, tokenizer, prompt: str, max_new_tokens: int, *, system: str = "", chat: bool = True,
            images: Sequence[object] = (), processor=None) -> list[Prompt]:
    """What `model` is given for `prompt`: one `Prompt` per image of `images` (PIL images, through `processor`,
    the model's own), or one without. With `chat` and a chat template (the processor's where images go through it,
    else the tokenizer's), the prompt is the user's turn after a `system` turn (none where empty) and the template's
    generation prompt follows; otherwise the prompt is continued as it is, and `system` must be empty. Every text is
    checked before tokenizing and every prompt against the context (PromptError)."""
    context = context_of(model, tokenizer)
    check_text(prompt, "prompt", context)
    check_text(system, "system", context)
    if images and not takes_images(model):
        raise PromptError(f"image: {type(model).__name__} (`{model.config.model_type}`) is a text-only model and "
                          "takes no image; disconnect the image, or load a vision-language model")
    template = _chat_template(tokenizer, processor if images else None) if chat else None
    if system and template is None:
        why = "chat is off" if not chat else "the model has no chat template"
        raise PromptError(f"system: {why}, so there is no system turn to put it in; leave it empty, or use a chat "
                          "model with chat on")
    fitted = []
    for image in images or [None]:
        inputs = _encoded(model, tokenizer, processor, prompt, system, image, template)
        room, note = fit_ids(inputs["input_ids"], model, context, max_new_tokens)
        fitted.append(Prompt(inputs, room, note, template is not None, image is not None))
    return fitted


def _chat_template(tokenizer, processor) -> str | None:
    """The chat template a prompt is framed by: the processor's where an image goes through it, else the
    tokenizer's; None where there is none."""
    found = getattr(processor, "chat_template", None) if processor is not None else None
    return found or getattr(tokenizer, "chat_template", None)


def _encoded(model, tokenizer, processor, prompt: str, system: str, image, template: str | None) -> dict:
    """The inputs of one prompt (and image) as transformers' own calls make them: the tokenizer's
    `apply_chat_template`, or the processor's (rendered by the tokenizer: SmolVLM's own needs a video processor,
    `processors`), else the tokenizer or processor on the raw text."""
    if template is not None:
        messages = ([{"role": "system", "content": _content(model, system)}] if system else []) + [
            {"role": "user", "content": _content(model, prompt, image is not None)}]
        if image is None:
            return dict(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True, return_tensors="pt"))
        text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
        # as the processor's own apply_chat_template: a rendered BOS is not added again
        starts = tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)
        extra = {"add_special_tokens": False} if starts else {}
    elif image is None:
        return dict(tokenizer(prompt, return_tensors="pt"))
    else:
        text, extra = prompt, {}
    try:
        return dict(processor(images=[[image]], text=[text], return_tensors="pt", **extra))
    except ValueError as exc:  # the processor's own check: e.g. a raw prompt without the model's image token
        raise PromptError(f"image: the model's processor refuses the prompt with its image ({exc}); with chat off "
                          "the prompt must hold the model's image token where the image goes") from None


def _content(model, text: str, image: bool = False) -> str | list[dict]:
    """A turn's content: plain text for a text model; a vision-language model's templates take a list of typed
    items (the image first, as their own examples put it)."""
    if not takes_images(model):
        return text
    return [{"type": "image"}] * image + [{"type": "text", "text": text}]
