"""A compiled block's view of the KV cache its model shares across layers, so every layer of one class shares its
graphs.

transformers' attention updates one cache for the whole model, `cache.update(k, v, self.layer_idx)`, which indexes
`cache.layers` by the layer's Python int: dynamo specializes on it, so each layer compiled graphs of its own and read
its slot by a path of its own (`cache.layers[3].keys`), guarded apart.

Invariants:
- a compiled block gets the cache as a view of the same class (its methods, and `isinstance`, unchanged) sharing the
  cache's state, whose layer list answers the block's own index (the one `layer_idx` its modules hold) with the
  block's slot, read by one path for every layer;
- the index asked is compared with the slot's inside the graph, both as unspecialized ints (`TRACING` holds while
  such a call traces), so the guard is the relation between them, which every layer meets; any other index (a block
  shared by several layers, a looped layer's offset) reads the shared list, as without the view: never another slot;
- a block holding no `layer_idx`, or several, and a call without a cache, are passed through unchanged.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from torch import nn

#: The dynamo setting a call that passes a view needs while it traces: a module's int attributes (`layer_idx`)
#: unspecialized, so comparing one with the slot's index guards their relation, not either value.
TRACING = {"allow_unspec_int_on_nn_module": True}


class CacheSlots:
    """Swaps a shared cache among a block's arguments for its view; remembers each block's index (weakly)."""

    def __init__(self) -> None:
        self._indices: weakref.WeakKeyDictionary[nn.Module, int | None] = weakref.WeakKeyDictionary()

    def bind(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        """`args` and `kwargs` with each layered cache replaced by `block`'s view of it, and whether any was."""
        cache_class = _cache_class()
        if cache_class is None:
            return args, kwargs, False
        if block not in self._indices:
            self._indices[block] = _layer_index(block)
        index = self._indices[block]

        def bindable(value: Any) -> bool:
            layers = getattr(value, "layers", None)
            return isinstance(value, cache_class) and isinstance(layers, list) and index < len(layers)

        if index is None or not any(map(bindable, (*args, *kwargs.values()))):
            return args, kwargs, False

        def view(value: Any) -> Any:
            return _view(value, index) if bindable(value) else value

        return tuple(map(view, args)), {name: view(value) for name, value in kwargs.items()}, True


class _SlotLayers:
    """A cache's layer list as one block sees it: its own index answers with its slot, read by one path."""

    def __init__(self, layers: list, index: int) -> None:
        self.layers, self.index, self.slot = layers, index, layers[index]

    def __getitem__(self, index):
        if index == self.index:  # traced with both sides symbolic: a relation, not a layer's value, is guarded
            return self.slot
        return self.layers[index]

    def __setitem__(self, index, layer) -> None:
        self.layers[index] = layer
        if index == self.index:
            self.slot = layer

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def append(self, layer) -> None:
        self.layers.append(layer)


def _view(cache: Any, index: int) -> Any:
    """An object of the cache's own class sharing its state (the same layers, settings and streams), whose layer
    list is the block's `_SlotLayers`."""
    view = object.__new__(type(cache))
    view.__dict__.update(cache.__dict__)
    view.layers = _SlotLayers(cache.layers, index)
    return view


def _layer_index(block: nn.Module) -> int | None:
    """The one `layer_idx` the block's modules hold (transformers' attention and decoder layers), else None."""
    indices = {value for module in block.modules() if type(value := getattr(module, "layer_idx", None)) is int}
    return indices.pop() if len(indices) == 1 else None


def _cache_class() -> type | None:
    """transformers' `Cache`, once transformers is loaded (before that, no argument can be one)."""
    module = sys.modules.get("transformers.cache_utils")
    return getattr(module, "Cache", None)
