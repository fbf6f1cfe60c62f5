"""A model folder's own processor (tokenizer, image processor or feature extractor, chat template), as transformers'
`AutoProcessor` reads it, read once per version of the folder's files: reading one costs as much as a few tokens of a
small model, and a host generates once per prompt. Never the folder's code."""

from __future__ import annotations

import functools
import os
from pathlib import Path

#: The files a processor's class is named in; one mapping it to the folder's own code is refused.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(folder: str | os.PathLike):
    """The processor of the model folder `folder`; a ValueError saying what is missing where it has none."""
    folder = Path(folder)
    stamp = tuple((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                  for entry in sorted(folder.iterdir()) if entry.is_file()) if folder.is_dir() else ()
    return _processor(str(folder), stamp)


@functools.lru_cache(maxsize=4)
def _processor(folder: str, stamp: tuple):
    import transformers

    from ..build.model_spec import refuse_remote_code

    for name in PROCESSOR_FILES:
        refuse_remote_code(folder, name, "AutoProcessor")
    try:
        return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"no processor (tokenizer, image processor or feature extractor, chat template) in "
                         f"{folder}: {exc}") from None
