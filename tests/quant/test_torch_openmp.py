"""Native tasks on torch's OpenMP workers: as many calls as threads asked for where torch's runtime allows it, one
call on the calling thread otherwise (a single thread, a forked process)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from forked import in_forked_child

numba = pytest.importorskip("numba", reason="numba (in the test extra) compiles the native task")
from streamwise.runtime.quant import torch_openmp  # noqa: E402
from streamwise.runtime.quant.gguf_fused_cpu import _fetch_add  # noqa: E402


@numba.cfunc(numba.types.void(numba.types.voidptr))
def _count_calls(data):
    _fetch_add(numba.carray(data, (1,), dtype=np.int64).ctypes.data, 1)


def calls(threads: int) -> int:
    counter = np.zeros(1, np.int64)
    torch_openmp.run(_count_calls.address, counter.ctypes.data, threads)
    return int(counter[0])


needs_openmp = pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch built without OpenMP")


@needs_openmp
def test_a_task_runs_once_per_thread_on_torch_workers():
    assert torch_openmp._gomp_parallel() is not None, "torch's OpenMP runtime has no GOMP_parallel"
    assert calls(3) == 3


def test_a_task_on_one_thread_runs_once():
    assert calls(1) == 1


@needs_openmp
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_process_runs_a_task_once_on_its_own_thread():
    """A runtime's workers are not carried over a fork: starting them in the child would hang it."""
    assert calls(2) == 2  # the parent's workers started
    assert in_forked_child(calls, 2) == (0, 1)


@numba.cfunc(numba.types.void(numba.types.voidptr))
def _meet(data):
    """Arrive, then wait (boundedly) for the other calls: counts in slot 1 the calls that saw all arrive at once."""
    slots = numba.carray(data, (3,), dtype=np.int64)
    _fetch_add(slots.ctypes.data, 1)
    for _ in range(200_000_000):
        if _fetch_add(slots.ctypes.data, 0) >= slots[2]:
            _fetch_add(slots.ctypes.data + 8, 1)
            return


def test_without_openmps_entry_point_a_task_runs_on_as_many_threads_at_once(monkeypatch):
    """What Windows does (a DLL's symbols do not resolve through its dependencies): the calls still run together,
    on a pool of threads of Streamwise's own, not one after another."""
    monkeypatch.setattr(torch_openmp, "_gomp_parallel", lambda: None)
    slots = np.array([0, 0, 3], np.int64)
    torch_openmp.run(_meet.address, slots.ctypes.data, 3)
    assert slots[:2].tolist() == [3, 3]
