"""ComfyUI's per-layer quantization metadata: `<layer>.comfy_quant`, a uint8 tensor of JSON.

An INT8 layer is stored as `<layer>.weight` (int8), `<layer>.weight_scale` (fp32, one per row)
and `<layer>.comfy_quant` = `{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}`.
Streamwise reads and writes exactly that; any other format is refused, never guessed at.
"""

from __future__ import annotations

import json

import torch
from torch import Tensor, nn

from ..engine import protocol
from .errors import CheckpointError

SUFFIX = ".comfy_quant"
INT8_TENSORWISE = "int8_tensorwise"


def encode(group_size: int | None) -> Tensor:
    meta = {"format": INT8_TENSORWISE, "convrot": bool(group_size)}
    if group_size:
        meta["convrot_groupsize"] = group_size
    return torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)


def decode(tensor: Tensor) -> tuple[str, int | None]:
    """(Streamwise format, ConvRot group size) of a `.comfy_quant` tensor; ValueError if unknown."""
    try:
        meta = json.loads(bytes(tensor.to(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
        fmt = meta["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable comfy_quant metadata ({exc})") from None
    if fmt != INT8_TENSORWISE:
        raise ValueError(f"comfy_quant format `{fmt}` is not one Streamwise reads ({INT8_TENSORWISE})")
    if meta.get("convrot"):
        group = meta.get("convrot_groupsize", 256)
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise ValueError(f"comfy_quant `convrot_groupsize` must be a positive integer, got {group!r}")
        return "convrot_int8", group
    return "int8", None


def state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors with INT8 residents in ComfyUI's convention, ready for safetensors."""
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    for path, module in model.named_modules():
        handler = protocol.quant_handler(module)
        if handler is not None and handler.name in ("int8", "convrot_int8"):
            tensors[f"{path}{SUFFIX}"] = encode(getattr(module, protocol.GROUP_SIZE))
        elif handler is not None:
            raise CheckpointError([f"`{path}` is a `{handler.name}` resident, which ComfyUI's comfy_quant "
                                   "convention cannot describe"])
    return tensors
