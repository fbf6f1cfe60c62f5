"""A loader node run again with other inputs, where memory is short.

ComfyUI still holds the node's previous model while the new one loads (its cache keeps the old output until the
prompt ends; v0.33's RAM-pressure cache keeps it longer), so a load the host budget cannot hold beside it would be
refused while that model fills the memory. Before refusing, the node's previous model gives its host memory back:
it leaves core's loaded models and its weights go back to their file (it still runs, reading them from there, should
a workflow use it again), and the load is tried once more.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ...checkpoint.tiers import HostBudgetError
from ...convert import applied_state
from ...engine import file_tier
from ...engine.exclusive import one_writer
from ...engine.journal import Journal
from ...host_memory import return_large_frees
from ...sizes import human

Loaded = TypeVar("Loaded", bound=tuple)
_log = logging.getLogger("streamwise.load")

#: Each loader node's latest model (its patcher), held weakly: once ComfyUI lets it go, so does this.
_PREVIOUS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def load_again(node_id: str | None, load: Callable[[], Loaded]) -> Loaded:
    """`load()` (a patcher first, then anything) for the loader node `node_id`; where the host budget refuses it
    (`HostBudgetError`) while the node's previous model lives, that model gives its host memory back first
    (`give_back_host_memory`) and `load()` runs once more."""
    previous = _PREVIOUS.get(node_id) if node_id is not None else None
    try:
        loaded = load()
    except HostBudgetError:
        given = 0 if previous is None else give_back_host_memory(previous)
        if not given:
            raise
        _log.info("loader %s: its previous model gave %s of host memory back (its weights back to their file)",
                  node_id, human(given))
        loaded = load()
    if node_id is not None:
        _PREVIOUS[node_id] = loaded[0]
    return loaded


def give_back_host_memory(patcher: Any) -> int:
    """Unload `patcher` from core, and put its tree's streamed weights back in their file (and let its staging go):
    the bytes of host memory given back (0: none could go)."""
    import comfy.model_management

    loaded = comfy.model_management.current_loaded_models
    for index in reversed(range(len(loaded))):
        if loaded[index].model is patcher:
            loaded.pop(index).model_unload()
    state = applied_state(patcher.model)
    if state is None:
        return 0
    with one_writer(patcher.model), Journal().atomic(lambda exc: None) as journal:
        given = file_tier.leave_tree_in_file(journal, patcher.model)
    if state.tree.file_tier is not None:
        state.tree.file_tier.drop_staging()
    return_large_frees()  # short of memory: a copied host tier's freed buffers go back to the system, not the heap
    return given
