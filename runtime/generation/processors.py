"""A model folder's own processor (tokenizer, image processor or feature extractor, chat template), as transformers'
`AutoProcessor` reads it, read once per version of the folder's files: reading one costs as much as a few tokens of a
small model, and a host generates once per prompt. Never the folder's code.

Without torchvision (a CPU build of torch it cannot be installed beside), transformers builds no video processor, so
it cannot build the processors that have one (Qwen2-VL's, SmolVLM's) at all; such a processor is built without its
video part, which images and text never use. ComfyUI installs torchvision, so there the processor is transformers'
own, whole.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from .errors import GenerationError

#: The files a processor's class is named in; one mapping it to the folder's own code is refused.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_NAMED_IN = (*PROCESSOR_FILES, "tokenizer_config.json")
_MAX_CONFIG = 16 * 2**20


def load_processor(folder: str | os.PathLike):
    """The processor of the model folder `folder`; a ValueError saying what is missing where it has none."""
    from ..checkpoint.discover import model_identity  # its GGUF header reader imports gguf: only when asked

    folder = Path(folder)
    return _processor(str(folder), model_identity(folder) if folder.is_dir() else ())


@functools.lru_cache(maxsize=4)
def _processor(folder: str, identity: tuple):
    import transformers

    from ..builders.model_spec import refuse_remote_code

    for name in PROCESSOR_FILES:
        refuse_remote_code(folder, name, "AutoProcessor")
    try:
        try:
            return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True,
                                                              trust_remote_code=False)
        except ImportError as exc:
            if "torchvision" not in str(exc).lower() or transformers.utils.is_torchvision_available():
                raise
            return _without_video(folder)
    except (OSError, ValueError, TypeError, KeyError, ImportError) as exc:
        raise GenerationError(f"no processor (tokenizer, image processor or feature extractor, chat template) in "
                         f"{folder}: {exc}") from None


def _without_video(folder: str):
    """The folder's processor class, built from its other parts: a subclass that leaves out `video_processor`."""
    import transformers

    named = next((name for name in map(_processor_class, (Path(folder) / file for file in _NAMED_IN)) if name), None)
    full = getattr(transformers, named, None) if named else None
    if not (isinstance(full, type) and issubclass(full, transformers.ProcessorMixin)):
        raise GenerationError(f"no processor class transformers ships is named in {', '.join(_NAMED_IN)}")

    class WithoutVideo(full):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return [name for name in super().get_attributes() if name != "video_processor"]

    WithoutVideo.__name__ = WithoutVideo.__qualname__ = full.__name__
    return WithoutVideo.from_pretrained(folder, video_processor=None, local_files_only=True, trust_remote_code=False)


def _processor_class(path: Path) -> str | None:
    try:
        if path.stat().st_size > _MAX_CONFIG:
            return None
        named = json.loads(path.read_text(encoding="utf-8")).get("processor_class")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return named if isinstance(named, str) else None
