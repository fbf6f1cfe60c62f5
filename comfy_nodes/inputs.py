"""What the pack's generation nodes need of their inputs, checked before anything runs: a MODEL they cannot drive is
a message that says what it is and which node drives it, never an exception from inside a library; an IMAGE becomes
the images a processor takes."""

from __future__ import annotations

import torch
from torch import nn

from ..runtime.convert import applied_state
from ..runtime.generation import Task, task_of
from .errors import NodeInputError

NODES: dict[Task, str] = {"text": "Streamwise Generate Text", "speech": "Streamwise Generate Speech"}


def loaded_tree(model: object, task: Task) -> tuple[nn.Module, str]:
    """The module tree inside `model` and the folder (or `.gguf`) it was loaded from, if it can generate `task`."""
    node = NODES[task]
    tree = getattr(model, "model", None)
    state = applied_state(tree) if isinstance(tree, nn.Module) else None
    if state is None or state.source is None:
        what = type(tree).__name__ if isinstance(tree, nn.Module) else type(model).__name__
        raise NodeInputError(f"{node} runs models the Streamwise Model Loader loaded (their tokenizer comes from the "
                         f"same folder); this MODEL holds a {what}: load it with the Streamwise Model Loader")
    found = task_of(tree)
    if found != task:
        instead = f"; use {NODES[found]} for it" if found is not None else ""
        raise NodeInputError(f"{node} cannot drive a {type(tree).__name__} (`{tree.config.model_type}`), which "
                         f"{'generates ' + found if found else 'generates neither text nor speech'}{instead}")
    return tree, state.source


def pil_images(image) -> list:
    """ComfyUI's IMAGE ([batch, height, width, channels], floats in 0..1) as the RGB images a processor takes, one
    per image of the batch; none for no input. Values round to the nearest byte, so an image a LoadImage read from a
    file comes back with that file's bytes."""
    if image is None:
        return []
    from PIL import Image

    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (1, 3, 4):
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise NodeInputError(f"image: {shape}, where an IMAGE is [batch, height, width, channels] with 1, 3 or 4 "
                             "channels")
    pixels = image.detach().to("cpu", torch.float32).mul(255).round().clamp(0, 255).to(torch.uint8).numpy()
    return [Image.fromarray(each[..., 0] if each.shape[-1] == 1 else each).convert("RGB") for each in pixels]
