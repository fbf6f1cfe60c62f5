"""Classes Streamwise derives at run time: streamed leaves, relocating containers, residents, host adaptations.

Invariants:
- one class per factory and arguments, made once and cached, so conversions of many modules share it;
- each derives from the class it was made from and names it (`protocol.ORIGINAL_CLASS`);
- instances pickle through the factory (a class made with `type()` has no import path), so `torch.save(model)`,
  multiprocessing and deepcopy work on converted trees.
"""

from __future__ import annotations

from collections.abc import Callable

from .protocol import ORIGINAL_CLASS

Namespace = Callable[[], dict[str, object]]
_DERIVED: dict[tuple[Callable[..., type], tuple], type] = {}


def derived_class(
    factory: Callable[..., type], args: tuple, name: str, base: type, namespace: Namespace,
    mixins: tuple[type, ...] = (),
) -> type:
    """The class `factory(*args)` stands for: `name`, derived from `mixins` and `base`, with `namespace()` (built
    on first use only: the per-module cost of a conversion is one dictionary lookup)."""
    key = (factory, args)
    cls = _DERIVED.get(key)
    if cls is None:
        body = {"__module__": factory.__module__, ORIGINAL_CLASS: getattr(base, ORIGINAL_CLASS, base), **namespace()}
        cls = _DERIVED[key] = type(name, (*mixins, base), {**body, **_picklable(factory, args)})
    return cls


def _picklable(factory: Callable[..., type], args: tuple) -> dict[str, object]:
    def __reduce_ex__(self, protocol):
        return _instance_of, (factory, args), self.__dict__

    return {"__reduce_ex__": __reduce_ex__}


def _instance_of(factory: Callable[..., type], args: tuple) -> object:
    cls = factory(*args)
    return cls.__new__(cls)
