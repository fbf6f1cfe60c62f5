"""Streamwise Generate Speech: a VibeVoice script and reference voices in, ComfyUI AUDIO out (see
runtime/generation/speech.py)."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..runtime.generation import MAX_SPEAKERS, TokenSteps, Voice, generate_speech
from .errors import NodeInputError
from .inputs import loaded_tree
from .schema import schema

SCRIPT = "Speaker 0: Hello, and welcome to the show.\nSpeaker 1: Thanks, it's great to be here."


def voice(name: str, audio: dict | None) -> Voice | None:
    """One reference recording from ComfyUI's AUDIO ({"waveform": [batch, channels, samples], "sample_rate"})."""
    if audio is None:
        return None
    waveform = audio["waveform"]
    if waveform.ndim != 3 or waveform.shape[0] != 1:
        raise NodeInputError(f"{name} holds {tuple(waveform.shape)}: give one recording, [1, channels, samples]")
    return Voice(waveform[0], int(audio["sample_rate"]))


class StreamwiseGenerateSpeech(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            category="audio", aliases=("vibevoice", "tts", "text to speech", "speech"),
            node_id="StreamwiseGenerateSpeech",
            display_name="Streamwise Generate Speech",
            description="Speak a multi-speaker script with a VibeVoice model loaded by the Streamwise Model Loader "
                        "(processor: its folder), optionally in the voices of reference recordings; the node plays it.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="A VibeVoice model from the Streamwise Model Loader (policy "
                                                "`vibevoice` or `auto`); its folder holds the processor."),
                io.String.Input("text", multiline=True, default=SCRIPT,
                                tooltip="The script, one 'Speaker N: text' per line (at most 4 speakers); a line "
                                        "without a speaker continues the one before."),
                io.Int.Input("seed", default=0, min=0, max=2**63 - 1, control_after_generate=True,
                             tooltip="Seeds the diffusion noise, so a run can be repeated."),
                io.Int.Input("steps", default=10, min=1, max=100,
                             tooltip="Diffusion steps per speech frame: more is slower and can sound cleaner."),
                io.Float.Input("cfg", default=1.3, min=0.0, max=10.0, step=0.05,
                               tooltip="Classifier-free guidance scale of the diffusion head (1: no guidance)."),
                io.Int.Input("max_new_tokens", default=4096, min=1, max=65536,
                             tooltip="The most speech frames to make (released VibeVoice makes 7.5 a second); "
                                     "it stops earlier at the end of the script."),
                *(io.Audio.Input(f"voice_{n}", optional=True,
                                 tooltip=f"Reference recording for the script's speaker number {n} in order (the "
                                         "lowest-numbered is 1st); any rate and channels, mixed to mono and "
                                         "resampled.")
                  for n in range(1, MAX_SPEAKERS + 1)),
            ],
            outputs=[io.Audio.Output("audio", display_name="audio",
                                     tooltip="The speech: one mono waveform at the model's sample rate.")],
        )

    @classmethod
    def execute(cls, model, text: str, seed: int, steps: int, cfg: float, max_new_tokens: int,
                voice_1=None, voice_2=None, voice_3=None, voice_4=None) -> io.NodeOutput:
        import comfy.model_management
        import comfy.utils

        tree, source = loaded_tree(model, "speech")
        voices = [voice(f"voice_{n}", audio) for n, audio in enumerate((voice_1, voice_2, voice_3, voice_4), 1)]
        comfy.model_management.load_models_gpu([model])
        frames = TokenSteps(comfy.utils.ProgressBar(max_new_tokens).update,
                            comfy.model_management.throw_exception_if_processing_interrupted)
        speech = generate_speech(tree, source, text, voices, seed=seed, steps=steps, cfg=cfg,
                                 max_new_tokens=max_new_tokens, device=model.load_device, stopping_criteria=[frames])
        audio = {"waveform": speech.waveform, "sample_rate": speech.sample_rate}
        return io.NodeOutput(audio, ui=ui.PreviewAudio(audio))  # a temporary FLAC the node's player loads
