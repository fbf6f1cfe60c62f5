"""`streamwise quantize`: write a checkpoint as GGUF, with GGML types chosen by a policy.

Each weight of a layer that a `gguf` quant rule selects is quantized to the rule's `gguf_type`
with the gguf package's own quantizers (Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, or F16/BF16/F32); every
other tensor keeps its type (the quantized blocks of a GGUF source too). Tensor names stay the
model's state-dict keys, so `streamwise.load` reads the file back into the same tree.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from ...schemas import Policy
from ..plan import plan_for
from ..quant.gguf_dequant import dequantize
from .readers import CheckpointError, StoredTensor, file_type, open_checkpoint


@dataclass(frozen=True)
class QuantizeReport:
    file: str
    tensors: int
    types: dict[str, int]
    bytes_in: int
    bytes_out: int


def quantize_to_gguf(
    source: str | os.PathLike, destination: str | os.PathLike, policy: Policy | str, model: nn.Module
) -> QuantizeReport:
    """Write `source` to `destination` (a new `.gguf`) as `policy` says; an existing destination is replaced
    only once the whole file is written, and the source is never the destination."""
    policy, plan = plan_for(policy, model)
    chosen = {entry.path: entry.gguf_type for entry in plan.modules if entry.gguf_type}
    destination = Path(destination)
    checkpoint = open_checkpoint(source)
    _check_destination(destination, {Path(t.file) for t in checkpoint.tensors.values()} | {Path(checkpoint.path)})
    handle, partial = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".partial", dir=destination.parent)
    os.close(handle)
    types: dict[str, int] = {}
    bytes_in = 0
    try:
        writer = gguf.GGUFWriter(partial, arch="streamwise")
        writer.add_string("streamwise.policy", policy.name)
        try:
            for name, stored in sorted(checkpoint.tensors.items()):
                gguf_type = chosen.get(name.rpartition(".")[0]) if name.endswith(".weight") else None
                data, qtype, size = _convert(name, stored, gguf_type)
                bytes_in += size
                writer.add_tensor(name, data, raw_dtype=qtype)
                label = (qtype.name if qtype is not None else str(data.dtype))
                types[label] = types.get(label, 0) + 1
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        # mkstemp makes the file private; the result takes the mode the file it replaces had, else the umask's
        os.chmod(partial, stat.S_IMODE(destination.stat().st_mode) if destination.exists() else _umask_mode())
        os.replace(partial, destination)
    except BaseException:
        Path(partial).unlink(missing_ok=True)  # never leave half a file behind, nor touch the destination
        raise
    return QuantizeReport(
        os.fspath(destination), sum(types.values()), dict(sorted(types.items())), bytes_in,
        os.path.getsize(destination),
    )


def _umask_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _check_destination(destination: Path, sources: set[Path]) -> None:
    if destination.suffix != ".gguf":
        raise CheckpointError([f"{destination}: the destination must be a `.gguf` file"])
    kind = file_type(destination)  # a name too long or with a NUL byte is a CheckpointError too
    if kind not in (None, stat.S_IFREG) or file_type(destination.parent) != stat.S_IFDIR:
        raise CheckpointError([f"{destination}: not a file in an existing folder"])
    if kind is not None and any(destination.samefile(s) for s in sources if s.exists()):
        raise CheckpointError([f"{destination}: is the source checkpoint; write the GGUF to a new file"])


def _convert(
    name: str, stored: StoredTensor, gguf_type: str | None,
) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None, int]:
    """The array to write, its GGML type, and the size of the source tensor it comes from.

    A source that is already quantized (a GGUF) keeps its blocks unless a rule asks for another
    type; then it is dequantized and encoded afresh.
    """
    raw = stored.read()
    size = raw.numel() * raw.element_size()
    if stored.qtype is None:
        return (*_encode(name, raw, gguf_type), size)
    if gguf_type is None or gguf_type == stored.qtype.name:
        return raw.numpy().reshape(*stored.shape[:-1], -1), stored.qtype, size
    try:
        values = dequantize(raw, stored.qtype, stored.shape)
    except ValueError as exc:  # a type without a dequantizer
        raise CheckpointError([f"{stored.file}: tensor `{name}`: {exc}"]) from None
    return (*_encode(name, values, gguf_type), size)


def _encode(
    name: str, tensor: torch.Tensor, gguf_type: str | None,
) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
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
        bf16 = gguf.GGMLQuantizationType.BF16
        return gguf.quants.quantize(tensor.float().numpy(), bf16), bf16
    if tensor.dtype not in _NUMPY_TYPES:
        raise CheckpointError([f"tensor `{name}`: GGUF cannot store {tensor.dtype}"])
    return tensor.numpy(), None


_NUMPY_TYPES = (torch.float32, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64)
