"""Raw GGML block bytes expanded into floats: the one place where the kernel is chosen, by device and type.

GGUF weights are streamed to the compute device as their raw block bytes (a uint8 tensor, the smallest thing to
move) and expanded there, right before use, by one of three kinds of kernel:

- the torch kernels (`gguf_torch_kernels`): every type, any device, bit-exact with `gguf.quants.dequantize` for
  float32 output (NaNs by place; NaN payloads too on the CPU), the oracle the others are held to. Their steps come
  in two designs: the reference (`gguf_fields`), fewest ops, for a GPU and any other device, and the CPU's
  (`gguf_cpu_fields`), whole contiguous planes, for the CPU;
- on the CPU, numba's fused kernels where numba is installed (`gguf_fused_cpu`, the twelve common types): one pass,
  the same bits;
- on CUDA, Triton's (`gguf_triton`, the legacy types, the K-quants, IQ4_NL/IQ4_XS and MXFP4): one kernel per type
  writing the compute dtype where it goes, the same bits (NaNs by place). On a CPU Triton is never chosen, even
  installed (there it runs as its interpreter, which is for the tests); a missing or failing Triton leaves the
  torch kernels, said once.

Inside a compiled graph or another tracer the torch kernels run (their ops are what the tracer records), but on
CUDA, where the graph calls Triton's kernel as an operator. The expansion is memory-bound; the output is a fresh
buffer on huge pages where the platform has them (see `huge_pages`), or the caller's.
"""

from __future__ import annotations

import math
from types import ModuleType

import gguf
import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..engine.tracing import compiled_call, plain_call
from . import gguf_tables, gguf_triton, huge_pages, numba_kernels
from .errors import QuantError
from .gguf_cpu_fields import CpuFields
from .gguf_fields import Fields, reinterpret
from .gguf_torch_kernels import DEQUANTIZERS

QType = gguf.GGMLQuantizationType

# Types stored as plain floats: their bytes are reinterpreted, not dequantized.
STORED_FLOATS: dict[QType, torch.dtype] = {
    QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16,
}


class UnsupportedQuantType(QuantError):
    """A GGML type without a dequantizer here."""


class BadBlocks(QuantError):
    """Bytes that are no GGML blocks of the type and shape given (a ValueError, or a TypeError for a tensor that is
    not raw bytes, as these were before)."""


def check_blocks(qtype: QType, shape: tuple[int, ...], nbytes: int) -> int:
    """The number of blocks `nbytes` of `qtype` hold for `shape`; raises if this module cannot expand them."""
    if qtype not in DEQUANTIZERS and qtype not in STORED_FLOATS:
        supported = ", ".join(t.name for t in [*STORED_FLOATS, *DEQUANTIZERS])
        raise UnsupportedQuantType(f"no dequantizer for GGML type {qtype.name}; supported: {supported}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise BadBlocks(
            f"{qtype.name} rows hold whole blocks of {block_size} values, but shape {shape} has rows of {row}"
        )
    n_blocks = math.prod(shape) // block_size
    if nbytes != n_blocks * type_size:
        raise BadBlocks(f"{qtype.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, got {nbytes}")
    return n_blocks


def dequantize(
    blocks: Tensor, qtype: QType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
) -> Tensor:
    """Expand raw GGML block bytes into a `dtype` tensor of `shape` (torch order, the reverse of GGUF's ne), written
    into `out` (uint8 bytes on the blocks' device, at least the result's) where given.

    Values are computed in float32 and then cast; F32 bytes read as float32 come back as a view of `blocks`.
    """
    shape = tuple(shape)
    if blocks.dtype != torch.uint8:
        raise BadBlocks(f"GGML blocks must be a uint8 tensor of raw bytes, got {blocks.dtype}")
    n_blocks = check_blocks(qtype, shape, blocks.numel())
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    kernel = DEQUANTIZERS.get(qtype)

    if out is None and blocks.is_cuda and torch.compiler.is_compiling() and qtype in gguf_triton.types():
        cols = shape[-1] if shape else 1  # a compiled graph calls the Triton kernel as an operator
        return torch.ops.streamwise.gguf_expand(blocks, int(qtype), math.prod(shape) // cols, cols, dtype).view(shape)

    def result(dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        if out is None:
            return huge_pages.empty(shape, dtype, blocks.device)
        return out[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    if n_blocks == 0:
        return torch.empty(shape, dtype=dtype, device=blocks.device)
    blocks = blocks.reshape(n_blocks, type_size)
    if kernel is None:
        stored = reinterpret(blocks, STORED_FLOATS[qtype]).reshape(shape)
        return stored if stored.dtype == dtype else result(dtype, shape).copy_(stored)
    if _fused_gpu(qtype, blocks):  # one kernel writing the compute dtype where it goes
        values = result(dtype, (n_blocks, block_size))
        if gguf_triton.dequantize(qtype, blocks, values):
            return values.view(shape)
    # float32 is computed where the result goes; another dtype from float32 of its own (the torch kernels' design)
    values = (result(torch.float32, (n_blocks, block_size)) if dtype == torch.float32
              else huge_pages.empty((n_blocks, block_size), torch.float32, blocks.device))
    fused = _fused_cpu(qtype, blocks)
    if fused is None:
        kernel(torch_fields(blocks.device), blocks, values)
    else:
        half = gguf_tables.CPU_TABLES["f16"].numpy()
        fused.dequantize(qtype, blocks.detach().contiguous().numpy(), values.numpy(), half)
    if dtype == torch.float32:
        return values.view(shape)
    return result(dtype, shape).copy_(values.view(shape))


def torch_fields(device: torch.device) -> Fields:
    """The design of the torch kernels' steps on `device`: the CPU's there, the reference elsewhere."""
    return CPU_FIELDS if device.type == "cpu" else FIELDS


FIELDS, CPU_FIELDS = Fields(), CpuFields()


def _fused_cpu(qtype: QType, blocks: Tensor) -> ModuleType | None:
    """`gguf_fused_cpu`, where it expands these blocks: on the CPU, outside a compiled graph and any other tracer (a
    dispatch mode: they record the torch kernels' ops, where a native call would leave an empty buffer in the
    trace), for the types it has, with numba installed and compiling (its kernels would run as Python without)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or blocks.device.type != "cpu":
        return None
    fused = numba_kernels.fused_dequant()
    return fused if fused is not None and qtype in fused.TYPES else None


def gpu_matmul(rows: Tensor, blocks: Tensor, qtype: QType, out_features: int) -> Tensor | None:
    """`rows` (a few, on CUDA) times the weight these blocks hold, transposed, in float32, from the blocks directly
    (`gguf_triton.matmul`: decode expands no weight; in a compiled graph as its operator); None where that kernel
    does not serve (more rows, another device or type, a gradient or another tracer): the caller expands instead."""
    if rows.shape[0] > gguf_triton.MATMUL_ROWS or not blocks.is_cuda or qtype not in gguf_triton.types():
        return None
    if plain_call(rows):
        return gguf_triton.matmul(rows, blocks, qtype, out_features)
    if compiled_call(rows):
        return torch.ops.streamwise.gguf_decode(rows, blocks, int(qtype), out_features)
    return None


def _fused_gpu(qtype: QType, blocks: Tensor) -> bool:
    """Whether `gguf_triton` expands these blocks: on CUDA (never on a CPU, where Triton would run as its
    interpreter), outside a compiled graph and any other tracer, for the types it has, with Triton installed."""
    return (blocks.is_cuda and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and qtype in gguf_triton.types())


def prepare(device: torch.device) -> None:
    """What the kernels need on `device`, made once. Every lookup table the reference design reads is copied there (a
    few MB; on the CPU nothing is copied): a graph compiled there afterwards reads them as inputs, where one copied
    while it is traced would break it. On the CPU the fused kernels are loaded too (numba: 43 MiB, and compiling them
    the first time on a machine, 80 MiB more while it lasts), so that a load holds that memory before it reads its
    host budget."""
    if device.type == "cpu":
        numba_kernels.fused_dequant()
        numba_kernels.matmul()
    gguf_tables.prepare(device)
