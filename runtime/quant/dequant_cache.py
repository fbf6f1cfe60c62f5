"""Dequantized weights a forward reuses, kept within a bound.

A resident expands its weight at every call. Most are called once per forward, but some are called again before
much else runs: ALBERT's one shared layer at every depth, a block a forward loops over, a small model whose whole
float weight fits. For those, per-call dequant would cost many expansions where one would do.

The cache is an LRU over the weights asked for, sized by their dequantized bytes, that admits a weight only when it
is asked for again while still inside the bound (the second ask within the window; before that only its key and
size are remembered). A model whose reuse distance exceeds the bound, such as an LLM called layer after layer, never
has a weight admitted and so holds nothing; memory held never exceeds `bound`. An entry stays valid while the
resident's stored tensors are the same objects at the same version and data address, for the same dtype and device
(a write through `.data`, which moves no version, is not seen: write the parameter itself). Entries are never
written after they are made, so autograd may keep one.

CPU only: there the expansion is slow; an accelerator expands fast and its memory is the device budget's. The bound
(`DEFAULT_BOUND`) lives in the host budget: a load under one lowers it to what the budget leaves after placing the
tree (`checkpoint.fill`), so the cache never pushes a weight into the file tier nor the process past its budget.
Inside a compiled graph the cache is bypassed (the compiler owns the expansion).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

DEFAULT_BOUND = 256 * 1024**2


@dataclass
class _Entry:
    module: weakref.ref
    size: int
    token: tuple = ()
    weight: Tensor | None = None


class DequantCache:
    """Dequantized weights of residents asked for again within `bound` bytes of other asks (see the module)."""

    def __init__(self, bound: int = DEFAULT_BOUND) -> None:
        self.bound = bound
        self._window: OrderedDict[int, _Entry] = OrderedDict()
        self._window_bytes = 0
        self._lock = threading.Lock()
        self._collected: list[int] = []  # ids of modules garbage-collected since the last ask (appended by weakref)

    def weight(self, module: nn.Module, stored: list[Tensor], dtype: torch.dtype, device: torch.device,
               size: int, expand: Callable[[], Tensor]) -> Tensor:
        """The dequantized weight of `module` (`size` bytes) in `dtype` on `device`: the cached one while `stored`
        (the module's stored tensors) is unchanged, else `expand()`, admitted when it was asked for recently."""
        if device.type != "cpu" or size > self.bound or torch.compiler.is_compiling():
            return expand()
        token = (dtype, device, *(_identity(t) for t in stored))
        with self._lock:
            while self._collected:
                self._drop(self._collected.pop())
            entry = self._window.get(id(module))
            if entry is not None and entry.module() is not module:  # an id reused by a newer module
                self._drop(id(module))
                entry = None
            if entry is not None:
                self._window.move_to_end(id(module))
                if entry.weight is not None and _same(entry.token, token):
                    return entry.weight
        weight = expand()
        with self._lock:
            entry = self._window.get(id(module))
            if entry is not None and entry.module() is module:
                entry.token, entry.weight = token, weight  # asked for again within the window: admitted
            else:
                self._drop(id(module))
                self._window[id(module)] = _Entry(weakref.ref(module, self._forget(id(module))), size)
                self._window_bytes += size
            while self._window_bytes > self.bound:
                self._drop(next(iter(self._window)))
        return weight

    def limit(self, room: int) -> None:
        """Lower the bound to `room` bytes (what a host budget leaves after a load placed a tree in it), for good:
        one bound serves every tree of the process, so the tightest budget sets it."""
        with self._lock:
            self.bound = max(0, min(self.bound, room))
            while self._window_bytes > self.bound:
                self._drop(next(iter(self._window)))

    @property
    def held(self) -> int:
        """Bytes of dequantized weights held now."""
        with self._lock:
            return sum(entry.size for entry in self._window.values() if entry.weight is not None)

    def clear(self) -> None:
        with self._lock:
            self._window.clear()
            self._window_bytes = 0

    def _forget(self, key: int) -> Callable[[weakref.ref], None]:
        """A weakref callback noting that module `key` is gone (dropped at the next ask: it may run under the lock)."""
        return lambda ref: self._collected.append(key)

    def _drop(self, key: int) -> None:
        entry = self._window.pop(key, None)
        if entry is not None:
            self._window_bytes -= entry.size


def _identity(tensor: Tensor) -> tuple:
    """What tells a stored tensor from its successor: the object, its version (writes in place) and its data's
    address (core's `.data` assignments), each where it has one (a stand-in has no address and is never written;
    an inference tensor, which ComfyUI's loads under `inference_mode` make, keeps no version)."""
    return weakref.ref(tensor), _or_none(lambda: tensor._version), _or_none(tensor.data_ptr)


def _or_none(read: Callable[[], int]) -> int | None:
    try:
        return read()
    except RuntimeError:
        return None


def _same(token: tuple, other: tuple) -> bool:
    """Whether two tokens name the same dtype, device and stored tensors at the same versions and addresses."""
    if token[:2] != other[:2] or len(token) != len(other):
        return False
    pairs = zip(token[2:], other[2:], strict=True)
    return all(a[0]() is not None and a[0]() is b[0]() and a[1:] == b[1:] for a, b in pairs)


#: The process's cache, used by every resident's forward (see `formats.QuantFormat.linear`).
DEQUANT_CACHE = DequantCache()
