"""Speech from a transformers VibeVoice model: a speaker script and reference voices in, one waveform out.

What the prompt looks like is the checkpoint's business (its processor's chat template), as are its generation
defaults (`model.generation_config`: its generation_config.json, which `load_pretrained` gives the model), so any
VibeVoice folder speaks the way its authors meant. Hosts add only what they own: a stopping criterion per token (a
progress bar, an interrupt) and the device.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from .errors import GenerationError
from .processors import load_processor

MAX_SPEAKERS = 4  # what VibeVoice was trained for


class Voice(NamedTuple):
    """A reference recording: `waveform` [channels, samples] or [samples] at `sample_rate` Hz."""

    waveform: torch.Tensor
    sample_rate: int


class Speech(NamedTuple):
    waveform: torch.Tensor
    """[1, 1, samples], float32 on the CPU."""
    sample_rate: int


def parse_script(script: str) -> list[tuple[str, str]]:
    """(speaker number, text) turns of a script in VibeVoice's form, one `Speaker N: text` per line. A line without
    that prefix continues the turn before it; a script without any prefix is one turn of speaker 0."""
    turns: list[tuple[str, str]] = []
    for line in script.splitlines():
        head, colon, rest = line.partition(":")
        words = head.split()
        if colon and len(words) == 2 and words[0].lower() == "speaker" and words[1].isdigit():
            turns.append((str(int(words[1])), rest.strip()))
        elif line.strip():
            speaker, text = turns.pop() if turns else ("0", "")
            turns.append((speaker, f"{text} {line.strip()}".strip()))
    turns = [(speaker, text) for speaker, text in turns if text]
    if not turns:
        raise GenerationError("the script has no text to speak: write lines such as 'Speaker 0: Hello.'")
    speakers = {speaker for speaker, _ in turns}
    if len(speakers) > MAX_SPEAKERS:
        raise GenerationError(f"the script has {len(speakers)} speakers; VibeVoice speaks at most {MAX_SPEAKERS}")
    return turns


def conversation(turns: Sequence[tuple[str, str]], voices: Sequence[Voice | None], sample_rate: int) -> list[dict]:
    """The chat messages VibeVoice's processor takes. Voices pair with the script's speakers in order of their
    numbers (the first voice is the lowest-numbered speaker, whether the script counts from 0 or from 1); each rides
    on its speaker's first turn, where the chat template looks for it."""
    speakers = sorted({speaker for speaker, _ in turns}, key=int)
    extra = [index for index, voice in enumerate(voices) if voice is not None and index >= len(speakers)]
    if extra:
        raise GenerationError(f"voice {extra[0] + 1} has no speaker: the script has {len(speakers)} "
                         f"({', '.join('Speaker ' + s for s in speakers)})")
    by_speaker = {speaker: voices[index] for index, speaker in enumerate(speakers)
                  if index < len(voices) and voices[index] is not None}
    messages = []
    for speaker, text in turns:
        content: list[dict] = [{"type": "text", "text": text}]
        voice = by_speaker.pop(speaker, None)
        if voice is not None:
            content.append({"type": "audio", "audio": mono(voice, sample_rate)})
        messages.append({"role": speaker, "content": content})
    return messages


def mono(voice: Voice, sample_rate: int):
    """The voice as the feature extractor takes it: one float32 channel at the model's rate (a band-limited
    polyphase resampler where the rates differ: scipy, which ComfyUI requires)."""
    waveform = voice.waveform.detach().to("cpu", torch.float32)
    if waveform.ndim not in (1, 2) or waveform.shape[-1] == 0:
        raise GenerationError(f"a voice must be [channels, samples] with samples; got shape {tuple(waveform.shape)}")
    samples = (waveform.mean(0) if waveform.ndim == 2 else waveform).numpy()
    if voice.sample_rate != sample_rate:
        from scipy.signal import resample_poly

        common = math.gcd(int(voice.sample_rate), sample_rate)
        samples = resample_poly(samples, sample_rate // common, int(voice.sample_rate) // common).astype("float32")
    return samples


def generate_speech(
    model,
    folder: str | os.PathLike,
    script: str,
    voices: Sequence[Voice | None] = (),
    *,
    seed: int,
    steps: int,
    cfg: float,
    max_new_tokens: int,
    device: torch.device | str | None = None,
    stopping_criteria: Iterable = (),
) -> Speech:
    """Speak `script` with `model` (a `VibeVoiceForConditionalGeneration` built from `folder`).

    `steps` diffusion steps make each speech frame and `cfg` is their classifier-free guidance scale; at most
    `max_new_tokens` frames are made (generation ends earlier at the model's end of speech). `seed` seeds the
    diffusion noise, so a run can be repeated. Each of `stopping_criteria` runs once per frame (transformers'
    stopping-criterion protocol): a host's progress bar and interrupt go there.
    """
    import transformers

    if getattr(getattr(model, "config", None), "model_type", None) != "vibevoice":
        raise GenerationError(f"{type(model).__name__} is no VibeVoice model: load a VibeVoice folder (transformers 5)")
    if importlib.util.find_spec("diffusers") is None:  # transformers' VibeVoice draws with its noise scheduler
        raise ImportError("speech needs diffusers: pip install diffusers (or streamwise[speech])")
    processor = load_processor(folder)
    rate = processor.feature_extractor.sampling_rate
    messages = conversation(parse_script(script), voices, rate)
    # sanitize: text in the script is spoken, never read as the model's control tokens.
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                           sanitize_control_tokens=True)
    inputs = inputs.to(device or model.device, model.dtype)
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=max_new_tokens, guidance_scale=cfg)
    torch.manual_seed(seed)  # the diffusion noise (and a voice's tokenizer sampling) draw from torch's generators
    with torch.no_grad():
        audio = model.generate(
            **inputs, generation_config=config, num_diffusion_steps=steps,
            stopping_criteria=transformers.StoppingCriteriaList(list(stopping_criteria)),
        )
    if audio[0] is None:
        raise GenerationError("the model ended the speech before making any audio")
    return Speech(audio[0].detach().to("cpu", torch.float32).reshape(1, 1, -1), rate)
