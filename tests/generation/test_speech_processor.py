"""Generate Speech's processor: read from the folder once per version of its files."""

from __future__ import annotations

from helpers import tiny_vibevoice_folder


def test_the_processor_is_read_once_per_version_of_its_folder(tmp_path):
    """Generating once per prompt must not reread the processor (as much as two frames of the tiny model), and an
    edited folder must not speak with the old one."""
    from streamwise.runtime.generation.speech import load_processor

    folder = tiny_vibevoice_folder(tmp_path / "voice")
    first = load_processor(folder)
    assert load_processor(folder) is first
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text())  # the same content, a new file time: the folder changed
    assert load_processor(folder) is not first
