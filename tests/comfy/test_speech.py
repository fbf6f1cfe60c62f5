"""Generate Speech headless on CPU: a tiny random VibeVoice folder through ComfyUI's loader, the Streamwise Model
Loader (policy `vibevoice`) and the node; the audio is noise, so shape, rate, seeds, voices and interrupts are what
is checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comfy_harness import load_custom_node
from helpers import REPO, decode_audio, module_from_file, tiny_vibevoice_folder

FRAMES = 6
HOP = 4  # samples per frame of the tiny acoustic tokenizer (downsampling 2 x 2)
SCRIPT = "Speaker 0: hello there\nSpeaker 1: how are you"


recording_progress_bar = module_from_file(Path(__file__).with_name("test_nodes.py")).recording_progress_bar


@pytest.fixture(scope="module")
def speech(comfy_nodes, tmp_path_factory):
    """The Generate Speech node and a MODEL the loader made of a tiny VibeVoice in a registered model folder; the
    node's previews go to a temporary folder, not the core checkout's."""
    import folder_paths

    assert load_custom_node(comfy_nodes, REPO)
    root = tmp_path_factory.mktemp("speech-models")
    tiny_vibevoice_folder(root / "tiny-vibevoice")
    folder_paths.add_model_folder_path("streamwise", str(root))
    mappings = comfy_nodes.NODE_CLASS_MAPPINGS
    patcher, report = mappings["StreamwiseModelLoader"].execute("streamwise/tiny-vibevoice", "auto", "auto").args
    assert "`auto` picked `vibevoice`" in report
    temp = folder_paths.get_temp_directory()
    folder_paths.set_temp_directory(str(tmp_path_factory.mktemp("speech-temp")))
    yield mappings["StreamwiseGenerateSpeech"], patcher
    folder_paths.set_temp_directory(temp)


def speak(node, patcher, seed=0, text=SCRIPT, frames=FRAMES, **voices) -> dict:
    (audio,) = node.execute(patcher, text, seed, 2, 1.3, frames, **voices).args
    return audio


def test_the_node_declares_audio_out_and_a_tooltip_on_every_input(speech):
    node, _ = speech
    assert node.OUTPUT_NODE is True
    assert list(node.RETURN_TYPES) == ["AUDIO"] and list(node.RETURN_NAMES) == ["audio"]
    inputs = node.INPUT_TYPES()
    assert list(inputs["required"]) == ["model", "text", "seed", "steps", "cfg", "max_new_tokens"]
    assert list(inputs["optional"]) == ["voice_1", "voice_2", "voice_3", "voice_4"]
    assert all(spec[1].get("tooltip") for spec in [*inputs["required"].values(), *inputs["optional"].values()])
    assert inputs["optional"]["voice_1"][0] == "AUDIO"


def test_speech_is_comfyui_audio_at_the_models_rate_one_progress_step_per_frame(speech, monkeypatch):
    node, patcher = speech
    bars = recording_progress_bar(monkeypatch)
    audio = speak(node, patcher)
    assert set(audio) == {"waveform", "sample_rate"} and audio["sample_rate"] == 24000
    waveform = audio["waveform"]
    assert waveform.dtype == torch.float32 and waveform.shape == (1, 1, FRAMES * HOP)
    assert torch.isfinite(waveform).all() and waveform.abs().sum() > 0
    (bar,) = bars
    assert bar.total == FRAMES and bar.values == list(range(1, FRAMES + 1))


def test_the_node_plays_its_speech_from_a_temporary_flac(speech):
    import folder_paths

    node, patcher = speech
    out = node.execute(patcher, SCRIPT, 0, 2, 1.3, FRAMES)
    (preview,) = out.ui.as_dict()["audio"]
    assert preview["type"] == "temp"
    path = Path(folder_paths.get_temp_directory()) / preview["subfolder"] / preview["filename"]
    samples, rate = decode_audio(path.read_bytes())
    assert rate == 24000 and samples.shape[1] == FRAMES * HOP
    gain = 2**-0.5 if samples.shape[0] == 2 else 1.0  # the Oct-2025 core writes mono as stereo, 3 dB down
    waveform = out.args[0]["waveform"][0]
    assert torch.allclose(samples, gain * waveform.expand_as(samples), atol=1e-4)  # 16-bit: within 2**-15 or so


def test_a_seed_repeats_its_speech_and_another_seed_does_not(speech):
    node, patcher = speech
    first = speak(node, patcher, seed=7)["waveform"]
    assert torch.equal(speak(node, patcher, seed=7)["waveform"], first)
    assert not torch.allclose(speak(node, patcher, seed=8)["waveform"], first)


def test_reference_voices_of_any_rate_and_channels_change_the_speech(speech):
    node, patcher = speech
    generator = torch.Generator().manual_seed(0)
    stereo_16k = {"waveform": torch.randn(1, 2, 400, generator=generator), "sample_rate": 16000}
    mono_24k = {"waveform": torch.randn(1, 1, 200, generator=generator), "sample_rate": 24000}
    plain = speak(node, patcher)["waveform"]
    voiced = speak(node, patcher, voice_1=stereo_16k, voice_2=mono_24k)
    assert voiced["waveform"].shape == plain.shape and voiced["sample_rate"] == 24000
    assert not torch.allclose(voiced["waveform"], plain)
    assert torch.equal(speak(node, patcher, voice_1=stereo_16k, voice_2=mono_24k)["waveform"], voiced["waveform"])
    with pytest.raises(ValueError, match="voice 3 has no speaker: the script has 2"):
        speak(node, patcher, voice_3=mono_24k)
    with pytest.raises(ValueError, match="voice_1 holds"):
        speak(node, patcher, voice_1={"waveform": torch.randn(2, 1, 200), "sample_rate": 24000})


def test_control_tokens_in_the_script_are_spoken_as_text(speech):
    """The audio placeholder written into a line must not be read as one (it would ask for a voice that is not
    there); a line without `Speaker N:` is speaker 0's."""
    node, patcher = speech
    audio = speak(node, patcher, text="<|vision_pad|> <|vision_end|> hello")
    assert audio["waveform"].shape == (1, 1, FRAMES * HOP)


def test_an_interrupt_stops_the_generation_within_a_frame(speech, monkeypatch):
    import comfy.model_management

    node, patcher = speech
    after = 3
    bars = recording_progress_bar(
        monkeypatch, lambda value: value == after and comfy.model_management.interrupt_current_processing(True))
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            speak(node, patcher, frames=10_000)
        assert not comfy.model_management.processing_interrupted()  # raised the way ComfyUI's own check does
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert bars[0].values == list(range(1, after + 1))  # the check runs right after the bar moves
    monkeypatch.undo()
    assert speak(node, patcher)["waveform"].shape == (1, 1, FRAMES * HOP)  # the model is still usable

