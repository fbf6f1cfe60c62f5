"""Picklable run-time classes: the streamed, relocating and resident classes Streamwise derives.

Pickle finds a class by its import path, which a class made with `type()` lacks. An instance of a
derived class therefore pickles as "ask the factory for the class again, then restore the
state", so `torch.save(model)`, multiprocessing and deepcopy work on converted trees.
"""

from __future__ import annotations

from typing import Callable


def picklable(factory: Callable[..., type], *args) -> dict[str, object]:
    """Class-namespace entries that make instances of `factory(*args)` pickle through `factory`."""

    def __reduce_ex__(self, protocol):
        return _instance_of, (factory, args), self.__dict__

    return {"__reduce_ex__": __reduce_ex__}


def _instance_of(factory: Callable[..., type], args: tuple) -> object:
    cls = factory(*args)
    return cls.__new__(cls)
