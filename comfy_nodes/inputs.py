"""What the pack's generation nodes need of their MODEL input, checked before anything runs: a model they cannot
drive is a message that says what it is and which node drives it, never an exception from inside a library."""

from __future__ import annotations

from torch import nn

from ..runtime.convert import applied_state
from ..runtime.generation import Task, task_of

NODES: dict[Task, str] = {"text": "Streamwise Generate Text", "speech": "Streamwise Generate Speech"}


def loaded_tree(model: object, task: Task) -> tuple[nn.Module, str]:
    """The module tree inside `model` and the folder (or `.gguf`) it was loaded from, if it can generate `task`."""
    node = NODES[task]
    tree = getattr(model, "model", None)
    state = applied_state(tree) if isinstance(tree, nn.Module) else None
    if state is None or state.source is None:
        what = type(tree).__name__ if isinstance(tree, nn.Module) else type(model).__name__
        raise ValueError(f"{node} runs models the Streamwise Model Loader loaded (their tokenizer comes from the "
                         f"same folder); this MODEL holds a {what}: load it with the Streamwise Model Loader")
    found = task_of(tree)
    if found != task:
        instead = f"; use {NODES[found]} for it" if found is not None else ""
        raise ValueError(f"{node} cannot drive a {type(tree).__name__} (`{tree.config.model_type}`), which "
                         f"{'generates ' + found if found else 'generates neither text nor speech'}{instead}")
    return tree, state.source
