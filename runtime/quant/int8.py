"""INT8 weights: symmetric, one fp32 scale per output row, optionally ConvRot-rotated.

The matmul takes the fastest exact-enough path the device offers: W8A8 where its shape rules hold (CUDA: more than
16 rows, K and N multiples of 8), in two Triton kernels (`w8a8_triton`) or else through `torch._int_mm`, W8A16 through
`torch._weight_int8pack_mm` on the CPU (bf16 activations, int8 weights), and dequantize-then-
matmul anywhere else (also on the CPU when in_features is not a multiple of 16, where torch's
packed kernel crashes), the weight dequantized in float32 before it takes the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..engine.tracing import compiled_call, plain_call
from . import w8a8_triton
from .convrot import rotate, unrotate

QMAX = 127


def quantize_int8(weight: Tensor, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """(int8 [out, in], fp32 scale [out]) for a float weight, rotated first when `group_size` is set."""
    w = weight.float()
    if group_size:
        w = rotate(w, group_size)
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, group_size: int | None, dtype: torch.dtype) -> Tensor:
    """The float weight in the original (unrotated) basis."""
    w = q.float() * scale.float()[:, None]
    if group_size:
        w = unrotate(w, group_size)
    return w.to(dtype)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, group_size: int | None) -> Tensor:
    if group_size:
        x = rotate(x, group_size)
    rows = x.reshape(-1, x.shape[-1])
    out_features, in_features = q.shape
    if rows.is_cuda and rows.shape[0] > 16 and in_features % 8 == 0 and out_features % 8 == 0:
        out = _w8a8(rows, q, scale)
    elif rows.device.type == "cpu" and in_features % 16 == 0:  # the packed kernel crashes on other K
        out = _w8a16(rows, q, scale)
    else:
        out = F.linear(rows, dequantize_int8(q, scale, None, rows.dtype))
    out = out.to(x.dtype).reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias.to(x.dtype)


_LIBRARY = torch.library.Library("streamwise", "FRAGMENT")
_LIBRARY.define("int8_w8a16(Tensor rows, Tensor q, Tensor scale) -> Tensor")
"""`torch._weight_int8pack_mm` in bf16 (float16 would flush small row scales to subnormals), as an operator of its own
so that inductor calls it opaquely (it cannot lower the kernel after a scale cast) and so that gradients reach the
activations, which the bare kernel does not allow. Defined with `Library` rather than `custom_op`, whose fake
registration asks `inspect` for its caller's source: a search of every loaded module, 60 ms of each import."""


@torch.library.impl(_LIBRARY, "int8_w8a16", "CPU")
def _w8a16_cpu(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    return torch._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(), q, scale.to(torch.bfloat16))


@torch.library.impl(_LIBRARY, "int8_w8a16", "Meta")  # also what fake tensors (compile's tracing) run
def _w8a16_meta(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    return rows.new_empty((rows.shape[0], q.shape[0]), dtype=torch.bfloat16)


def _w8a16_context(ctx, inputs, output) -> None:
    rows, q, scale = inputs
    ctx.rows_dtype = rows.dtype
    ctx.save_for_backward(q, scale)


def _w8a16_backward(ctx, grad: Tensor):
    q, scale = ctx.saved_tensors
    return grad.to(ctx.rows_dtype) @ dequantize_int8(q, scale, None, ctx.rows_dtype), None, None


torch.library.register_autograd("streamwise::int8_w8a16", _w8a16_backward, setup_context=_w8a16_context)
_w8a16 = torch.ops.streamwise.int8_w8a16


def _w8a8(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """Dynamic per-row activation quantization, an int8×int8→int32 GEMM, then both scales: two Triton kernels where
    Triton serves (`w8a8_triton`, the same arithmetic; in a compiled graph as their operator), else torch's eight."""
    if compiled_call(rows) and w8a8_triton.available():
        return _w8a8_operator(rows, q, scale)
    fused = w8a8_triton.w8a8(rows, q, scale) if plain_call(rows) else None
    return _w8a8_torch(rows, q, scale) if fused is None else fused


_LIBRARY.define("int8_w8a8(Tensor rows, Tensor q, Tensor scale) -> Tensor")
"""The two Triton kernels as one operator, which a compiled graph calls opaquely (its meta gives the output's shape:
no graph break) where tracing would put torch's eight kernels in the graph."""


@torch.library.impl(_LIBRARY, "int8_w8a8", "CompositeExplicitAutograd")
def _w8a8_kernels(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    fused = w8a8_triton.w8a8(rows, q, scale)
    return _w8a8_torch(rows, q, scale) if fused is None else fused


@torch.library.impl(_LIBRARY, "int8_w8a8", "Meta")
def _w8a8_meta(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    return rows.new_empty((rows.shape[0], q.shape[0]), dtype=torch.float32)


_w8a8_operator = torch.ops.streamwise.int8_w8a8


def _w8a8_torch(rows: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    x_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=torch.finfo(torch.float32).tiny) / QMAX
    xq = torch.round(rows.float() / x_scale).clamp(-QMAX, QMAX).to(torch.int8)
    return torch._int_mm(xq, q.t()).float() * x_scale * scale.float()[None, :]
