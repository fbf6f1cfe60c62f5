"""Devices as users name them, read the same way by every host that places weights (`offload`, `dispatch`)."""

from __future__ import annotations

import torch


def weight_device(value: object, what: str, error: type[Exception]) -> torch.device:
    """`value` as a torch.device that can hold weights; `error`, saying `what` was given, where it is no device or
    is `meta` (which holds no data: weights placed there would be lost)."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise error(f"{what} is not a device ({exc})") from exc
    if device.type == "meta":
        raise error(f"{what}: meta holds no data, so the weights placed there would be lost")
    return device
