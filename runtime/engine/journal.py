"""The journal: every in-place change one operation makes to a tree, with how to undo it.

`apply`, `revert`, `offload`, `load`, `dispatch` and the quantized residents all change trees through a `Journal`,
so one failure (Ctrl-C included) undoes every class swap, instance attribute, tensor slot and device move, newest
first. This module sits below the engine and the quant residents alike: both import it, it imports neither.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import Tensor, nn

from .tree import move_in_place

if TYPE_CHECKING:
    import torch

ABSENT = object()
"""What a record holds for an attribute the instance did not have."""


class Record:
    """Objects changed alike: the class they had, and each instance attribute the change may have set, with what it
    held before (a dict, for one object) or as a tuple of names none of the objects held.

    A record is its own undo (a journal entry): calling it restores the objects.
    """

    __slots__ = ("modules", "original_class", "replaced", "role")

    def __init__(self, modules: list, original_class: type, replaced: dict[str, object] | tuple[str, ...],
                 role: str) -> None:
        self.modules = modules
        self.original_class = original_class
        self.replaced = replaced  # ABSENT: the instance held nothing under that name
        self.role = role  # "stream", "relocate", "resident" or "host" (a host's adaptation of the root, see hosts/)

    def __call__(self) -> None:
        replaced = self.replaced
        for module in self.modules:
            object.__setattr__(module, "__class__", self.original_class)
            held = module.__dict__
            if type(replaced) is tuple:
                for name in replaced:
                    held.pop(name, None)
                continue
            for name, previous in replaced.items():
                if previous is ABSENT:
                    held.pop(name, None)
                else:
                    held[name] = previous


def _as_now(target: object, names: Iterable[str], role: str = "") -> Record:
    """A record restoring `target`'s class and the instance attributes `names` to what they are now."""
    held = target.__dict__
    return Record([target], type(target), {name: held.get(name, ABSENT) for name in names}, role)


class _RootRecord(Record):
    """A record of the root, held weakly: the root holds the state that holds the records, so a strong reference back
    is a cycle that keeps a dropped model alive until a full collection (ComfyUI warns of a potential leak)."""

    __slots__ = ("_root",)

    @property
    def modules(self) -> list[nn.Module]:
        root = self._root()
        return [] if root is None else [root]

    @modules.setter
    def modules(self, value: list[nn.Module]) -> None:
        (root,) = value
        self._root = weakref.ref(root)


class Journal:
    """The changes one operation made to a tree, undone newest first when the operation fails (apply, revert,
    offload, load)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    @contextmanager
    def atomic(self, error: Callable[[Exception], Exception | None]) -> Iterator[Journal]:
        """Run an operation: on any failure undo everything journaled, then re-raise the failure, an `Exception`
        as `error(exc)` (from it) unless that gives None, an interrupt as it is."""
        try:
            yield self
        except BaseException as exc:
            self.rollback()
            wrapped = error(exc) if isinstance(exc, Exception) else None
            if wrapped is None:
                raise
            raise wrapped from exc

    def swap_class(self, module: nn.Module, cls: type, attributes: dict[str, object], role: str, *,
                   clears: tuple[str, ...] = (), root: bool = False) -> Record:
        return self.add(swap_class(module, cls, attributes, role, clears=clears, root=root))

    def add(self, undo: Callable[[], None]) -> Callable[[], None]:
        """Journal `undo`, the undo of a change about to be made or just made."""
        self._undo.append(undo)
        return undo

    def set_tensor(self, module: nn.Module, name: str, value: Tensor) -> None:
        """Put `value` in the parameter or buffer slot `name` of `module` (a parameter if none holds it yet)."""
        slots = module._buffers if name in module._buffers else module._parameters
        previous = slots.get(name, ABSENT)
        self._undo.append(lambda: slots.pop(name, None) if previous is ABSENT else slots.__setitem__(name, previous))
        slots[name] = value

    def move(self, module: nn.Module, name: str, device: torch.device) -> None:
        """`move_in_place`, undone by moving back: a parameter to its device and pinning (the same object, never a
        second copy held meanwhile), a buffer by putting the one it replaced back."""
        if name in module._parameters:
            tensor = module._parameters[name]
            was, pinned = tensor.device, tensor.is_pinned()
            self._undo.append(lambda: move_in_place(module, name, was, pin=pinned))
        else:
            self.set_tensor(module, name, module._buffers[name])
        move_in_place(module, name, device)

    def set_data(self, parameter: nn.Parameter, value: Tensor) -> None:
        """Give `parameter` the values and storage of `value` (the same Parameter object: every alias of it stays
        valid), undone by giving its own back."""
        previous = parameter.data
        self._undo.append(lambda: setattr(parameter, "data", previous))
        parameter.data = value

    def move_data(self, parameter: nn.Parameter, value: Tensor) -> None:
        """Give `parameter` the storage of `value`, which holds its values already: undone by a copy of them in
        storage of its own, so the journal holds no second copy meanwhile (packing the host tier never holds it
        twice)."""
        self._undo.append(lambda: setattr(parameter, "data", parameter.data.clone()))
        parameter.data = value

    def keep(self, target: object, names: Iterable[str]) -> None:
        """Restore `target`'s instance attributes `names` on failure: they are about to change."""
        self._undo.append(_as_now(target, names))

    def set_attributes(self, target: object, attributes: dict[str, object]) -> None:
        self.keep(target, attributes)
        target.__dict__.update(attributes)

    def restore(self, record: Record) -> None:
        """Undo `record` (a completed operation's change), journaling how the objects are now."""
        self._undo.extend(_as_now(module, record.replaced, record.role) for module in record.modules)
        record()

    def rollback(self) -> None:
        while self._undo:
            self._undo.pop()()


def swap_class(module: nn.Module, cls: type, attributes: dict[str, object], role: str, *,
               clears: tuple[str, ...] = (), root: bool = False, alike: Record | None = None) -> Record:
    """Give `module` the class `cls` and plain `attributes`, returning how to undo it: the class back, `attributes`
    and `clears` (names a host may set on the instance later) as they were.

    `alike`: the record of modules given `cls` the same way, none of which held its names (which cover `attributes`
    and `clears`); `module` joins it when it holds none either (one record for a class's modules, not one each).
    The record holds the module weakly when it is the `root` that will keep the record.
    """
    held = module.__dict__
    if alike is not None and not root and held.keys().isdisjoint(alike.replaced):
        alike.modules.append(module)  # first: undoing a module not converted yet changes nothing
        record = alike
    else:
        names = tuple(dict.fromkeys((*attributes, *clears)))
        replaced = names if held.keys().isdisjoint(names) else {name: held.get(name, ABSENT) for name in names}
        record = (_RootRecord if root else Record)([module], type(module), replaced, role)
    object.__setattr__(module, "__class__", cls)  # past nn.Module.__setattr__, which only looks for tensors here
    held.update(attributes)
    return record
