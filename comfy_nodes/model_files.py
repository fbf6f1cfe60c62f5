"""Which model files a picker offers: `.safetensors` and `.gguf` files, and folders that hold a
`config.json` (a Hugging Face checkpoint, listed once as a whole). Labels resolve back to paths
only inside the folders they were listed from.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def list_models(roots: dict[str, Iterable[str | os.PathLike]]) -> dict[str, Path]:
    """`{"<folder key>/<relative path>": path}` for every model under the given roots."""
    found: dict[str, Path] = {}
    for key, folders in roots.items():
        for folder in map(Path, folders):
            if not folder.is_dir():
                continue
            for current, dirs, files in os.walk(folder):
                here = Path(current)
                if (here / "config.json").is_file() and here != folder:
                    found[f"{key}/{here.relative_to(folder).as_posix()}"] = here
                    dirs.clear()  # the folder is one model: its weight files are not listed again
                    continue
                for name in sorted(files):
                    if name.endswith(WEIGHT_SUFFIXES) and not name.endswith(".index.json"):
                        found[f"{key}/{(here / name).relative_to(folder).as_posix()}"] = here / name
    return dict(sorted(found.items()))


def resolve_model(label: str, roots: dict[str, Iterable[str | os.PathLike]]) -> Path:
    models = list_models(roots)
    if label not in models:
        raise FileNotFoundError(f"no model `{label}` in the model folders (is it still there?)")
    return models[label]
