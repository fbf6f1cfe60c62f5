"""Facts of a class that no policy changes (the names selectors compare, whether its forward takes an input),
worked out once per class and kept while the class lives.

A cold resolve reads a new policy, but the classes of a running process are the ones it met before: what depends
on the class alone is not worked out again (`benchmarks/bench_resolve.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import TypeVar
from weakref import WeakKeyDictionary

T = TypeVar("T")


def class_fact(compute: Callable[..., T]) -> Callable[..., T]:
    """`compute(cls, *args)`, memoized per class (weakly: a class made and dropped is not kept, so a fact must not
    refer to its class) and arguments."""
    facts: WeakKeyDictionary[type, dict[tuple[Hashable, ...], T]] = WeakKeyDictionary()

    @functools.wraps(compute)
    def fact(cls: type, *args: Hashable) -> T:
        known = facts.get(cls)
        if known is None:
            known = facts[cls] = {}
        try:
            return known[args]
        except KeyError:  # first sight of the class with these arguments
            value = known[args] = compute(cls, *args)
            return value

    return fact
