"""A per-token hook for `generate`: hosts move a progress bar and raise their interrupt there, so generation stops
within a token of being asked instead of at its end."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TokenSteps:
    """A stopping criterion that never stops: it runs once per new token (a speech frame), calls `progress(1)`, then
    `check_interrupt()`, which raises to stop."""

    def __init__(self, progress: Callable[[int], object], check_interrupt: Callable[[], object]) -> None:
        self.progress = progress
        self.check_interrupt = check_interrupt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.progress(1)
        self.check_interrupt()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
