"""A model's own small files (config.json, generation config, tokenizer) carried in the metadata of a GGUF Streamwise
writes, so the `.gguf` stands alone: `load_pretrained(file.gguf)` builds its model and `load_tokenizer` its tokenizer
from them, as llama.cpp's files carry what rebuilds theirs.

Each file is one metadata string, under `streamwise.file.<name>` (UTF-8 text as it is, so `gguf-dump` shows it) or
`streamwise.file_base64.<name>` (a binary file such as `spiece.model`); `streamwise.files` lists the names, early in
the header, so a listing knows a file stands alone without reading its whole header. Only the names in `CARRIED`
are written or unpacked, so a hostile file cannot name a path; what is unpacked goes into a private temporary folder
that is gone once the model or tokenizer is built, and is read by the same checks as a model folder (no remote
code).
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import CheckpointError

CARRIED = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model",
)
"""What a model folder holds that builds the model and its tokenizer, beside the weights."""

TOKENIZER = CARRIED[2:]
"""The tokenizer's files among them."""

MAX_CARRIED = 64 * 2**20
"""The most bytes of files a GGUF carries (a large vocabulary's tokenizer.json is ~30 MB)."""

ARCHITECTURE = "streamwise"
"""The `general.architecture` of the GGUF files Streamwise writes (tensors named as the model's state dict)."""

LISTED = "streamwise.files"
_TEXT, _BINARY = "streamwise.file.", "streamwise.file_base64."


def collect(folder: Path) -> dict[str, bytes]:
    """The files of `CARRIED` in `folder`; a CheckpointError where together they pass `MAX_CARRIED`."""
    found = {name: folder / name for name in CARRIED if (folder / name).is_file()}
    total = sum(path.stat().st_size for path in found.values())
    if total > MAX_CARRIED:
        raise CheckpointError([f"{folder}: the model's files ({', '.join(found)}) take {total} bytes; a GGUF carries "
                               f"at most {MAX_CARRIED}"])
    return {name: path.read_bytes() for name, path in found.items()}


def metadata(files: dict[str, bytes]) -> list[tuple[str, str]]:
    """The metadata strings carrying `files`, the list of names first."""
    pairs = [(LISTED, ",".join(files))]
    for name, data in files.items():
        try:
            pairs.append((_TEXT + name, data.decode("utf-8")))
        except UnicodeDecodeError:
            pairs.append((_BINARY + name, base64.b64encode(data).decode("ascii")))
    return pairs


def listed(values: dict[str, object]) -> list[str]:
    """The names of the files a GGUF's metadata says it carries (none where it lists none, or not as a string)."""
    found = values.get(LISTED)
    return found.value.split(",") if found is not None and isinstance(found.value, str) and found.value else []


def carried(values: dict[str, object], path: str) -> dict[str, bytes]:
    """The files a GGUF's metadata (`values`: key -> its `Value`) carries, by name; a CheckpointError naming the key
    where one is malformed."""
    names = listed(values)
    unknown = sorted(set(names) - set(CARRIED))
    if unknown:
        raise CheckpointError([f"{path}: `{LISTED}` names {', '.join(unknown)}; a GGUF carries only "
                               f"{', '.join(CARRIED)}"])
    files = {}
    for name in names:
        text, binary = values.get(_TEXT + name), values.get(_BINARY + name)
        found = text if text is not None else binary
        if found is None or not isinstance(found.value, str):
            raise CheckpointError([f"{path}: `{LISTED}` names {name}, but no string `{_TEXT}{name}` holds it"])
        try:
            files[name] = found.value.encode("utf-8") if text is not None else base64.b64decode(found.value,
                                                                                                  validate=True)
        except binascii.Error:
            raise CheckpointError([f"{path}: `{_BINARY}{name}` is not base64"]) from None
    return files


@contextmanager
def unpacked(files: dict[str, bytes]) -> Iterator[Path]:
    """A private temporary folder (mode 0700) holding `files`, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="streamwise-carried-"))
    try:
        for name, data in files.items():
            descriptor = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                                 0o600)
            with open(descriptor, "wb") as handle:
                handle.write(data)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
