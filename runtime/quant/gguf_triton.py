"""GGML blocks expanded on a GPU by one Triton kernel per type: the raw blocks read once, the compute dtype written
once, straight into the caller's memory (the streaming engine's reused expansion buffer).

The torch kernels (`gguf_torch_kernels`) take 4 to 35 ops a type, each a launch and a pass over float32 intermediates; a
kernel here reads a block's bytes, decodes its scales and quants in registers, and writes each value once, in the
compute dtype. Its arithmetic is the reference's, operation for operation (the float16 scales widened to float32,
each product and sum rounded as the reference rounds it: `m + d * q`, never fused into one rounding, as the launch
asks the compiler: `enable_fp_fusion=False`), so float32 output has the torch kernels' bits and a half-precision
output their float32 result rounded to nearest even; NaNs match by place (a GPU keeps no NaN payload).

Chosen by `gguf_dequant.dequantize` on CUDA only: on a CPU Triton runs as its interpreter, which is for the tests
(`TRITON_INTERPRET=1`: the same kernels, checked against the torch kernels in `tests/quant/test_gguf_triton.py`).
A missing or failing Triton leaves the torch kernels, said once (`triton_support`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .triton_support import available, launched

MATMUL_ROWS = 8
"""The most input rows `matmul` takes (token-by-token decode, a few sequences): more expand once into the buffer
and take the vendor's matmul, whose tiles beat recomputing the expansion for every row tile."""


def dequantize(qtype: int, blocks: Tensor, out: Tensor) -> bool:
    """Expand `blocks` ((n_blocks, type_size) uint8) into `out` ((n_blocks, values) of the compute dtype, contiguous,
    on the blocks' device) where a kernel here has the type; False where none has it, or it failed (said once, and
    the caller expands with the torch kernels)."""
    kernels = _kernels()
    size = kernels.VALUES.get(int(qtype)) if kernels is not None else None
    if size is None:
        return False
    n_blocks, per_program = blocks.shape[0], 2048 // size
    grid = (-(-n_blocks // per_program),)
    return launched(f"dequantize {kernels.Q(int(qtype)).name}", kernels.dequantize, grid, blocks, out, n_blocks,
                    blocks.shape[1], QTYPE=int(qtype), VALUES=size, BLOCKS=per_program)


def matmul(x: Tensor, blocks: Tensor, qtype: int, out_features: int) -> Tensor | None:
    """x (rows, in_features; at most `MATMUL_ROWS` rows, any float dtype) times the weight whose GGML blocks are
    `blocks` (its bytes, out_features rows), transposed: float32 (rows, out_features), every product summed in
    float32 and no weight expanded to memory; None where no kernel here has the type or it failed (said once)."""
    kernels = _kernels()
    size = kernels.VALUES.get(int(qtype)) if kernels is not None else None
    if size is None or x.shape[0] > MATMUL_ROWS:
        return None
    rows, k_blocks = x.shape[0], x.shape[1] // size
    out = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
    features = 32 if size == 32 else 8
    grid = (-(-out_features // features),)
    ran = launched(f"matmul {kernels.Q(int(qtype)).name}", kernels.matmul, grid, x.contiguous(), blocks, out, rows,
                   out_features, k_blocks, blocks.numel() // (out_features * k_blocks), QTYPE=int(qtype),
                   VALUES=size, ROWS=max(1, 1 << (rows - 1).bit_length()), FEATURES=features)
    return out if ran else None


def types() -> frozenset[int]:
    """The GGML types a kernel here expands (none where Triton is not available)."""
    kernels = _kernels()
    return frozenset(kernels.VALUES) if kernels is not None else frozenset()


_LIBRARY = torch.library.Library("streamwise", "FRAGMENT")
_LIBRARY.define("gguf_expand(Tensor blocks, int qtype, int rows, int cols, ScalarType dtype) -> Tensor")
"""The expansion as an operator, which a compiled graph calls opaquely (its meta says the output's shape: no graph
break) where tracing would put the torch kernels' ops in the graph: on CUDA the Triton kernel runs inside it.
Defined with `Library`, as the CPU kernels' operators are (`cpu_matmul`)."""


@torch.library.impl(_LIBRARY, "gguf_expand", "CompositeExplicitAutograd")
def _expand(blocks: Tensor, qtype: int, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    from .gguf_dequant import QType, dequantize

    return dequantize(blocks, QType(qtype), (rows, cols), dtype)


@torch.library.impl(_LIBRARY, "gguf_expand", "Meta")  # also what fake tensors (compile's tracing) run
def _expand_meta(blocks: Tensor, qtype: int, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    return blocks.new_empty((rows, cols), dtype=dtype)


_LIBRARY.define("gguf_decode(Tensor rows, Tensor blocks, int qtype, int out_features) -> Tensor")
"""`matmul` as an operator, so that a compiled graph's decode step multiplies by the blocks too (its meta gives the
output's shape: no graph break); where the kernel does not serve, it expands the weight and multiplies in float32."""


@torch.library.impl(_LIBRARY, "gguf_decode", "CompositeExplicitAutograd")
def _decode(rows: Tensor, blocks: Tensor, qtype: int, out_features: int) -> Tensor:
    out = matmul(rows, blocks, qtype, out_features)
    if out is not None:
        return out
    from .gguf_dequant import QType, dequantize

    return torch.nn.functional.linear(rows.float(), dequantize(blocks, QType(qtype), (out_features, rows.shape[1])))


@torch.library.impl(_LIBRARY, "gguf_decode", "Meta")
def _decode_meta(rows: Tensor, blocks: Tensor, qtype: int, out_features: int) -> Tensor:
    return rows.new_empty((rows.shape[0], out_features), dtype=torch.float32)


@functools.cache
def _kernels():
    """The kernels' module (`gguf_triton_kernels`), imported at the first call (Triton imported then, as
    `TRITON_INTERPRET` is read when a kernel is defined); None where Triton is not available."""
    if not available():
        return None
    from . import gguf_triton_kernels

    return gguf_triton_kernels
