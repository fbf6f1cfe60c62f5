"""The kernel modules numba builds (an optional dependency: `pip install streamwise[cpu-kernels]`), loaded where it is
installed and builds them; None elsewhere, and the torch route computes instead."""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

_log = logging.getLogger("streamwise.quant")
_MATMUL: ModuleType | None | bool = False  # False: not loaded yet


@functools.cache
def fused_dequant() -> ModuleType | None:
    """`gguf_fused_cpu`: GGUF blocks expanded in one pass."""
    return _load("gguf_fused_cpu", "expand GGUF weights with the torch kernels")


def matmul() -> ModuleType | None:
    """`cpu_matmul`: matmuls reading quantized storage in place. A plain global, loaded before a graph is compiled
    (`gguf_dequant.prepare`), so that a compiled forward reads it without a break."""
    global _MATMUL
    if _MATMUL is False:
        _MATMUL = _load("cpu_matmul", "expand quantized weights before each CPU matmul")
    return _MATMUL


def _load(name: str, instead: str) -> ModuleType | None:
    try:
        kernels = importlib.import_module(f"{__package__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("numba", "llvmlite"):
            raise
        return None  # numba, an optional dependency, not installed: nothing to say
    except Exception as exc:  # numba there but unusable (built for another numpy) or its compiler failed: said once
        _log.warning("Streamwise's numba kernels (%s) could not be built (%r); the torch route will %s", name, exc,
                     instead)
        return None
    return None if kernels.numba.config.DISABLE_JIT else kernels
