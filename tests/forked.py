"""A function run in a forked child, for tests of what a process keeps across a fork."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable


def in_forked_child(function: Callable, *args, timeout: float = 60) -> tuple[int | None, object]:
    """The child's exit code and what `function(*args)` returned there (None where it hung or died). A hung child
    (what such tests catch) is killed rather than left to outlive the test."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=lambda: send.send(function(*args)), daemon=True)
    child.start()
    try:
        answer = receive.recv() if receive.poll(timeout) else None
        child.join(10)
    finally:
        child.kill()
    return child.exitcode, answer
