"""Which generation a converted tree can run: text (a transformers causal or sequence-to-sequence LM, or a
vision-language model, which generates text from a text prompt alone too) or speech (VibeVoice). Decided from the
class by transformers' own task mappings, before anything runs, so a tree that cannot generate the asked thing is a
clear error rather than a failure deep inside `generate()`."""

from __future__ import annotations

from typing import Literal

from torch import nn

Task = Literal["text", "speech"]
_SPEECH_TYPES = {"vibevoice"}


def task_of(model: nn.Module) -> Task | None:
    """What `model` generates (None: neither text nor speech, or not a transformers model)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in _SPEECH_TYPES:
        return "speech"
    from transformers.models.auto import modeling_auto

    mappings = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES")
    names = {name for mapping in mappings for value in getattr(modeling_auto, mapping, {}).values()
             for name in ((value,) if isinstance(value, str) else value)}
    if type(model).__name__ in names and callable(getattr(model, "generate", None)):
        return "text"
    return None
