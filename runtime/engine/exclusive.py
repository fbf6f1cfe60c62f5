"""One writer per tree: the operations that change a tree (apply, revert, offload, load, dispatch) run one at a time
for one root.

Each is atomic on its own, but two at once on one root would interleave their changes (one thread's revert undoing
half of another's apply) and leave a half-converted tree that neither can undo. A second thread's call waits for the
first to finish, then sees the tree as the first left it: converted once, or as it was. The lock is reentrant
(offload and load apply inside their own operation) and held weakly by its root, so a dropped model takes its lock
with it and the tree itself is never touched to hold it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()  # WeakKeyDictionary's setdefault is not atomic


@contextmanager
def one_writer(root: nn.Module) -> Iterator[None]:
    """Hold `root`'s writer lock for the duration (waiting for another thread's operation on it to finish)."""
    with _GUARD:
        lock = _LOCKS.get(root)
        if lock is None:
            lock = _LOCKS[root] = threading.RLock()
    with lock:
        yield
