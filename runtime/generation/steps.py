"""Where a host's interrupt is checked during generation: at every new token (`TokenSteps`, which also moves a
progress bar), before every forward (a prefill chunk, a new token) and before every block of one
(`interrupt_at_blocks`), so a long prompt's prefill stops within one block's compute instead of at its end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


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


@contextmanager
def interrupt_at_blocks(model: nn.Module, check_interrupt: Callable[[], object]) -> Iterator[int]:
    """While inside, `check_interrupt()` runs before each forward of `model` (a prefill chunk) and of each of its
    blocks (the classes transformers names in `_no_split_modules`: a decoder layer, an encoder block); yields how many
    blocks. Hooks only: nothing of the model changes, and they are gone after. A compiled graph traces nothing of
    them."""

    def before(module, args):
        if not torch.compiler.is_compiling():
            check_interrupt()

    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m.register_forward_pre_hook(before) for m in model.modules() if type(m).__name__ in names]
    handles = [*blocks, model.register_forward_pre_hook(before)]
    try:
        yield len(blocks)
    finally:
        for handle in handles:
            handle.remove()
