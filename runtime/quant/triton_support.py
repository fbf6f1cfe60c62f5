"""What every Triton kernel of Streamwise shares: whether Triton serves here, and a launch that falls back.

Triton kernels run on CUDA only (on a CPU Triton runs as its interpreter, which is for the tests:
`TRITON_INTERPRET=1`). A missing or old Triton, or a kernel that fails to compile or launch, leaves the torch
kernels, and the log says so once: a quantized model never stops because of its fast path.
"""

from __future__ import annotations

import functools
import logging

_log = logging.getLogger("streamwise.quant")

MINIMUM = (3, 0)
"""The oldest Triton these kernels are written for (`triton.language` as torch 2.4's CUDA wheels ship it)."""


@functools.cache
def available() -> bool:
    """Whether Triton (at least `MINIMUM`) is importable here; where it is not, the log says so once."""
    try:
        import triton
    except ImportError:
        _log.info("Triton is not installed: quantized weights compute on the GPU with torch's kernels (slower)")
        return False
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < MINIMUM:
        _log.warning("Triton %s is older than %s: quantized weights compute on the GPU with torch's kernels",
                     triton.__version__, ".".join(map(str, MINIMUM)))
        return False
    return True


_failures: set[str] = set()


def launched(name: str, kernel, grid: tuple[int, ...], *args, **constants) -> bool:
    """Whether `kernel` ran on `grid`, floating-point contraction off (each product and sum rounded as the torch
    kernels round it); a failure is said once per `name`, and the caller computes with the torch kernels."""
    try:
        kernel[grid](*args, **constants, enable_fp_fusion=False)
    except Exception as exc:  # a compiler or driver Triton cannot serve: the torch kernels always can
        if name not in _failures:
            _failures.add(name)
            _log.warning("the Triton kernel `%s` failed (%s); it computes with torch's kernels instead", name, exc)
        return False
    return True
