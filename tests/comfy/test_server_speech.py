"""Generate Speech through a real ComfyUI server (test_server.py's harness): the shipped speech workflow on a tiny
random VibeVoice, its FLAC fetched back through /view, a seed changed, and an interrupt during a long generation."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

from helpers import REPO, decode_audio, module_from_file

harness = module_from_file(Path(__file__).with_name("test_server.py"))
server = harness.server  # the same server fixture: main.py --cpu with the pack, stopped at the end
WORKFLOW = REPO / "examples" / "workflows" / "streamwise_generate_speech.json"
HOP = 4  # samples per frame of the tiny VibeVoice


def graph() -> dict:
    return json.loads(WORKFLOW.read_text())


def speech_of(server, entry: dict):
    """The samples and rate of the FLAC the Generate Speech node previewed, fetched as the frontend's player does."""
    (preview,) = entry["outputs"]["2"]["audio"]
    query = urllib.parse.urlencode({key: preview[key] for key in ("filename", "subfolder", "type")})
    with urllib.request.urlopen(f"{server.url}/view?{query}", timeout=30) as response:
        return decode_audio(response.read())


def test_the_server_offers_generate_speech_and_the_tiny_vibevoice(server):
    info = server.request("/object_info/StreamwiseGenerateSpeech")["StreamwiseGenerateSpeech"]
    assert info["output_node"] is True and info["output"] == ["AUDIO"]
    assert set(info["input"]["optional"]) == {"voice_1", "voice_2", "voice_3", "voice_4"}
    loader = server.request("/object_info/StreamwiseModelLoader")["StreamwiseModelLoader"]
    assert "streamwise/tiny-vibevoice" in loader["input"]["required"]["model"][1]["options"]


def test_the_speech_workflow_makes_audio_and_a_seed_repeats_it(server):
    workflow = graph()
    frames = workflow["2"]["inputs"]["max_new_tokens"]
    started = time.monotonic()
    entry = server.run(workflow)
    seconds = time.monotonic() - started
    samples, rate = speech_of(server, entry)
    print(f"speech workflow: {tuple(samples.shape)} at {rate} Hz in {seconds:.1f} s")
    assert rate == 24000 and samples.shape[1] == frames * HOP and samples.abs().max() > 0.01
    assert (samples == samples[:1]).all()  # mono (the Oct-2025 core writes it as two equal channels)

    workflow["2"]["inputs"]["seed"] = 1
    other = server.run(workflow)
    assert harness.cached_nodes(other) == {"1"}  # the model stays loaded: only the speech runs again
    assert not (speech_of(server, other)[0] == samples).all()
    workflow["2"]["inputs"]["seed"] = 0
    again, _ = speech_of(server, server.run(workflow))
    assert (again == samples).all()


def test_interrupt_ends_a_long_speech_within_a_second(server):
    workflow = graph()
    workflow["2"]["inputs"]["max_new_tokens"] = 65536
    _, seconds = server.interrupted(workflow)
    assert seconds < 1.0  # within a frame, plus the /history poll
    server.run(graph())  # the model stays ready for the next prompt
