"""Running a native task on torch's own OpenMP threads.

A CPU kernel compiled outside torch (numba's) that ran on threads of its own would share the cores with torch's
OpenMP workers, which spin for milliseconds after each torch op before they sleep: between torch ops such a kernel
ran no faster on two threads than on one. Started through the `GOMP_parallel` entry point of the OpenMP runtime
torch's CPU library links (found through that library, since a process may hold several runtimes: sentencepiece
bundles its own), the task runs on those very workers instead. GNU's libgomp has the entry point, and LLVM's and
Intel's runtimes export it for code GCC built. Where torch has no OpenMP or the entry point cannot be found (on
Windows a DLL's symbols do not resolve through its dependencies), the task runs on the calling thread and as many
threads of a pool of this module's own (ctypes releases the GIL for the call). In a forked process (a runtime's
workers and a pool's threads are not carried over a fork, and starting OpenMP's there hangs), it runs once, on the
calling thread.
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

_TASK_SIGNATURE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_forked = False


def run(task: int, data: int, threads: int) -> None:
    """Call the native `void task(void *data)` at address `task` on `threads` of torch's OpenMP workers (the caller
    among them) at once, or, where that cannot be, once on the calling thread: it must split its work among however
    many calls it gets. The GIL is released meanwhile."""
    if threads <= 1 or _forked:
        _TASK_SIGNATURE(task)(data)
    elif (parallel := _gomp_parallel()) is not None:
        parallel(task, data, threads, 0)
    else:
        function = _TASK_SIGNATURE(task)
        helpers = [_pool().submit(function, data) for _ in range(threads - 1)]
        function(data)
        for helper in helpers:
            helper.result()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Threads of this module's own, where torch's OpenMP workers cannot be reached: as many as the machine has cores
    (a call asks for at most torch's thread count), started as calls need them."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="streamwise-kernels")


@functools.cache
def _gomp_parallel():
    """`GOMP_parallel(fn, data, num_threads, flags)` of torch's OpenMP runtime, or None."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        # torch's extension, already loaded, is not loaded again: a symbol resolves through its dependencies (on
        # POSIX), down to the OpenMP runtime libtorch_cpu links, wherever the installation keeps it
        parallel = ctypes.CDLL(torch._C.__file__).GOMP_parallel
    except (OSError, AttributeError):
        return None
    parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    return parallel


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
