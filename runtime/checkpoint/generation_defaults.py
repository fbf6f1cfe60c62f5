"""A checkpoint's own generation settings: what `generate` does when its caller says nothing more (the tokens that end
a turn, the tokens never to emit, the sampling its authors chose), read where the checkpoint keeps them.

A model built from its `config.json` knows none of them: transformers keeps them in `generation_config.json` beside
it, and `from_pretrained` reads that file after building (an older checkpoint keeps them in `config.json` itself,
which the built config drops). llama.cpp's files keep them in their token metadata: `eos`, `eot` (end of turn) and
`eom` (end of message) ids, and llama.cpp ends generation at any token spelled as one of its known end markers too.
`load_pretrained` gives every model it builds the settings found here, so every generation starts from them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import CheckpointError

FILE = "generation_config.json"
MAX_BYTES = 4 * 2**20
"""The largest generation_config.json read (real ones hold under 4 KB; Whisper's, with its suppressed tokens, 4 KB)."""

#: The end-of-generation tokens llama.cpp recognizes by their text (`src/llama-vocab.cpp`), beside the ids the
#: metadata names: chat models end their turn with one of these whatever `eos` says.
LLAMA_CPP_END_MARKERS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|end_of_text|>",
})
_END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def from_folder(folder: str | os.PathLike):
    """The generation settings of the model folder `folder`, as transformers' `from_pretrained` reads them: its
    generation_config.json, else the generation fields its config.json holds; None where it has neither (a model a
    registered builder made from other files). A CheckpointError naming the file where one is unreadable, too large,
    holds a setting transformers refuses, or a token id that is no integer, which `generate` would fail on deep
    inside."""
    import transformers

    folder = Path(folder)
    name = next((name for name in (FILE, "config.json") if (folder / name).is_file()), None)
    if name is None:
        return None
    path = folder / name
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError([f"{path}: {exc.strerror}"]) from None
    if size > MAX_BYTES:
        raise CheckpointError([f"{path}: {size} bytes, more than the {MAX_BYTES} a generation config may take"])
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError([f"{path}: not a JSON file transformers can read ({exc})"]) from None
    if not isinstance(values, dict):
        raise CheckpointError([f"{path}: holds a {type(values).__name__}, where a JSON object of settings belongs"])
    try:
        settings = transformers.GenerationConfig.from_pretrained(folder, config_file_name=name, local_files_only=True,
                                                                 _from_model_config=name == "config.json")
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # its validator's refusals, the file gone since
        raise CheckpointError([f"{path}: {exc}"]) from None
    problems = [f"{path}: `{name}` is {value!r}, where token ids are integers" for name, value in _not_ids(settings)]
    if problems:
        raise CheckpointError(problems)
    return settings


_TOKEN_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id", "suppress_tokens",
                 "begin_suppress_tokens")


def _not_ids(settings) -> list[tuple[str, object]]:
    """The token-id fields of `settings` holding something other than integers, which `generate` fails on deep
    inside (an id past the vocabulary it leaves alone: nothing is ever suppressed or ended at there)."""
    found = [(name, getattr(settings, name, None)) for name in _TOKEN_FIELDS]
    return [(name, value) for name, value in found if value is not None and not all(
        isinstance(each, int) and not isinstance(each, bool) for each in (value if isinstance(value, list) else
                                                                          [value]))]


def from_llama_cpp(config, metadata: dict, tokens: list[str] | None):
    """The generation settings of a llama.cpp GGUF whose model `config` transformers built from it: the config's own
    (bos, eos, pad), generation ending at every token llama.cpp ends at (`metadata`: the GGUF's values by key; `tokens`:
    its vocabulary, for the end markers spelled out)."""
    import transformers

    settings = transformers.GenerationConfig.from_model_config(config)
    ends = [ids[0] for key in _END_IDS if (value := metadata.get(key)) is not None
            and (ids := value.integers) is not None and len(ids) == 1 and ids[0] >= 0]
    ends += [index for index, text in enumerate(tokens or ()) if text in LLAMA_CPP_END_MARKERS]
    ends = list(dict.fromkeys(ends))
    if ends:
        settings.eos_token_id = ends[0] if len(ends) == 1 else ends
    return settings
