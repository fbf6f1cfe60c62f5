"""`streamwise quantize`: write a checkpoint as GGUF, with GGML types chosen by a policy.

Each weight of a layer that a `gguf` quant rule selects is quantized to the rule's `gguf_type`
with the gguf package's own quantizers (Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, or F16/BF16/F32); every
other tensor keeps its float type. Tensor names stay the model's state-dict keys, so
`streamwise.load` reads the file back into the same tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from ..schemas import Policy
from .checkpoint import CheckpointError, open_checkpoint
from .diagnostics import PolicyError
from .resolve import resolve


@dataclass(frozen=True)
class QuantizeReport:
    file: str
    tensors: int
    types: dict[str, int]
    bytes_in: int
    bytes_out: int


def quantize_to_gguf(source: str | os.PathLike, destination: str | os.PathLike, policy: Policy, model: nn.Module) -> QuantizeReport:
    plan = resolve(policy, model)
    if not plan.ok:
        raise PolicyError(plan.diagnostics)
    chosen = {entry.path: entry.gguf_type for entry in plan.modules if entry.gguf_type}
    checkpoint = open_checkpoint(source)
    partial = Path(destination).with_name(Path(destination).name + ".partial")
    writer = gguf.GGUFWriter(os.fspath(partial), arch="streamwise")
    writer.add_string("streamwise.policy", policy.name)
    types: dict[str, int] = {}
    bytes_in = 0
    try:
        for name, stored in sorted(checkpoint.tensors.items()):
            tensor = stored.read()
            bytes_in += tensor.numel() * tensor.element_size()
            data, qtype = _encode(name, tensor, chosen.get(name.rpartition(".")[0]) if name.endswith(".weight") else None)
            writer.add_tensor(name, data, raw_dtype=qtype)
            label = (qtype.name if qtype is not None else str(data.dtype))
            types[label] = types.get(label, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)  # never leave half a file behind, nor touch the destination
        raise
    writer.close()
    os.replace(partial, destination)
    return QuantizeReport(os.fspath(destination), sum(types.values()), dict(sorted(types.items())), bytes_in, os.path.getsize(destination))


def _encode(name: str, tensor: torch.Tensor, gguf_type: str | None) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """The array to write and its GGML type (None: the array's own numpy type)."""
    if gguf_type is not None:
        qtype = gguf.GGMLQuantizationType[gguf_type]
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        if gguf_type in ("F32", "F16"):
            return tensor.to(torch.float32 if gguf_type == "F32" else torch.float16).numpy(), None
        if tensor.ndim >= 2 and tensor.shape[-1] % block == 0:
            return gguf.quants.quantize(tensor.float().numpy(), qtype), qtype
    # Not quantized (or rows that do not fill whole blocks): the tensor's own type, unchanged.
    if tensor.dtype == torch.bfloat16:
        return gguf.quants.quantize(tensor.float().numpy(), gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    if tensor.dtype not in _NUMPY_TYPES:
        raise CheckpointError([f"tensor `{name}`: GGUF cannot store {tensor.dtype}"])
    return tensor.numpy(), None


_NUMPY_TYPES = (torch.float32, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64)
