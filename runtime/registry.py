"""One registry shape for every extension table: compute kinds, quant formats, dequantizers, migrations, builders.

Invariants:
- a second entry under a taken name is refused with a message saying what to do, never silently replaced;
- iteration follows `order`: registration order, or newest first where later entries must win (builders);
- torch-free, so the policy front end can use it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Literal, TypeVar

from ..errors import Error

T = TypeVar("T")


class AlreadyRegistered(Error, ValueError):
    """A second entry under a name a registry already holds."""


class Registry(Generic[T]):
    def __init__(self, what: str, *, order: Literal["registration", "newest-first"] = "registration") -> None:
        self.what = what
        self.order = order
        self._entries: dict[Hashable, T] = {}

    def register(self, name: Hashable, entry: T) -> T:
        if name in self._entries:
            label = getattr(name, "name", name)
            raise AlreadyRegistered(f"{self.what} `{label}` is already registered; register yours under another name")
        self._entries[name] = entry
        return entry

    def decorator(self, name: Hashable, make: Callable[[str, T], object] | None = None) -> Callable[[T], T]:
        """`@registry.decorator(name)`: register the decorated object (or `make(name, obj)`), return it unchanged."""

        def register(obj: T) -> T:
            self.register(name, obj if make is None else make(name, obj))
            return obj

        return register

    def __getitem__(self, name: Hashable) -> T:
        return self._entries[name]

    def get(self, name: Hashable, default: T | None = None) -> T | None:
        return self._entries.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Hashable]:
        names = list(self._entries)
        return iter(reversed(names) if self.order == "newest-first" else names)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[Hashable, T]]:
        return [(name, self._entries[name]) for name in self]

    def values(self) -> list[T]:
        return [self._entries[name] for name in self]
