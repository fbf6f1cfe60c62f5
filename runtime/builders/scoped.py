"""Changing what a process-wide function does for the calling thread (and context) only.

Some effects a build needs live in process-wide functions (`nn.Module.register_parameter`, for parameters on
meta; `torch.get_default_dtype`, which model code reads). A `ContextPatch` wraps such a function while any caller
is inside it, and the wrapper acts only where the caller's `ContextVar` is set: a model built meanwhile in
another thread sees the function unchanged.

Invariants:
- the wrapper is installed while at least one context is inside, and the original restored when the last
  leaves (unless someone patched the attribute after us: theirs is left in place, and ours stays inert);
- outside every context the wrapper behaves exactly as the original.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any


class ContextPatch:
    """`owner.name` replaced by `make(original, value)` where a context entered `active(value)`."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable, Callable[[], Any]], Callable]) -> None:
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        self.value: ContextVar[Any] = ContextVar(f"streamwise_{name}", default=None)
        self.wrapper = make(self.original, self.value.get)
        self._lock = threading.Lock()
        self._users = 0

    @contextmanager
    def active(self, value: Any) -> Iterator[None]:
        """Make the wrapper act with `value` in this context for the duration."""
        with self._lock:
            if self._users == 0:
                setattr(self.owner, self.name, self.wrapper)
            self._users += 1
        token = self.value.set(value)
        try:
            yield
        finally:
            self.value.reset(token)
            with self._lock:
                self._users -= 1
                if self._users == 0 and getattr(self.owner, self.name) is self.wrapper:
                    setattr(self.owner, self.name, self.original)
