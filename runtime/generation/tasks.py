"""Which generation a converted tree can run: text (a transformers causal or sequence-to-sequence LM) or speech
(VibeVoice). Decided from the class by transformers' own task mappings, before anything runs, so a tree that cannot
generate the asked thing is a clear error rather than a failure deep inside `generate()`."""

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

    names = {*modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(),
             *modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values()}
    if type(model).__name__ in names and callable(getattr(model, "generate", None)):
        return "text"
    return None
