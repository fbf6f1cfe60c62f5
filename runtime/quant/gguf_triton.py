"""GGML blocks expanded on a GPU by one Triton kernel per type: the raw blocks read once, the compute dtype written
once, straight into the caller's memory (the streaming engine's reused expansion buffer).

The torch kernels (`gguf_dequant`) take 4 to 35 ops a type, each a launch and a pass over float32 intermediates; a
kernel here reads a block's bytes, decodes its scales and quants in registers, and writes each value once, in the
compute dtype. Its arithmetic is the reference's, operation for operation (the float16 scales widened to float32,
each product and sum rounded as the reference rounds it: `m + d * q`, never fused into one rounding, as the launch
asks the compiler: `enable_fp_fusion=False`), so float32 output has the torch kernels' bits and a half-precision
output their float32 result rounded to nearest even; NaNs match by place (a GPU keeps no NaN payload).

Chosen by `gguf_dequant.dequantize` on CUDA only: on a CPU Triton runs as its interpreter, which is for the tests
(`TRITON_INTERPRET=1`: the same kernels, checked against the torch kernels in `tests/quant/test_gguf_triton.py`).
A missing or failing Triton leaves the torch kernels, said once (`available`).
"""

from __future__ import annotations

import functools
import logging

from torch import Tensor

_log = logging.getLogger("streamwise.quant")

MINIMUM = (3, 0)
"""The oldest Triton these kernels are written for (`triton.language` as torch 2.4's CUDA wheels ship it)."""

@functools.cache
def available() -> bool:
    """Whether Triton (at least `MINIMUM`) is importable here; where it is not, the torch kernels expand on the GPU,
    and the log says so once."""
    try:
        import triton
    except ImportError:
        _log.info("Triton is not installed: GGUF weights expand on the GPU with torch's kernels (slower)")
        return False
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < MINIMUM:
        _log.warning("Triton %s is older than %s: GGUF weights expand on the GPU with torch's kernels",
                     triton.__version__, ".".join(map(str, MINIMUM)))
        return False
    return True


def dequantize(qtype: int, blocks: Tensor, out: Tensor) -> bool:
    """Expand `blocks` ((n_blocks, type_size) uint8) into `out` ((n_blocks, values) of the compute dtype, contiguous,
    on the blocks' device) where a kernel here has the type; False where none has it, or it failed (said once, and
    the caller expands with the torch kernels)."""
    found = _kernels().get(int(qtype))
    if found is None:
        return False
    kernel, per_program = found
    n_blocks = blocks.shape[0]
    try:
        kernel[(-(-n_blocks // per_program),)](blocks, out, n_blocks, blocks.shape[1], BLOCKS=per_program,
                                               enable_fp_fusion=False)
    except Exception as exc:  # a compiler or driver Triton cannot serve: the torch kernels always can
        _failed(int(qtype), exc)
        return False
    return True


def types() -> frozenset[int]:
    """The GGML types a kernel here expands (none where Triton is not available)."""
    return frozenset(_kernels())


_failures: set[int] = set()


def _failed(qtype: int, exc: Exception) -> None:
    if qtype not in _failures:
        _failures.add(qtype)
        _log.warning("the Triton kernel of GGML type %d failed (%s); that type expands with torch's kernels", qtype,
                     exc)


@functools.cache
def _kernels() -> dict[int, object]:
    """The kernel of each type, by GGML type number: imported at the first call (Triton imported then, as
    `TRITON_INTERPRET` is read when a kernel is defined)."""
    if not available():
        return {}
    from . import gguf_triton_kernels

    return gguf_triton_kernels.KERNELS
