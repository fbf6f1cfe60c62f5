"""The numerical probe: a specific kind named for a class it is not proven for is checked on real weights.

`kinds.fit` proves what it can from the class alone (the kind was made for it, or its forward is a verbatim copy);
a rule that names a specific kind for any other class could silently compute something else (GPT-2's transposed
`Conv1D` as `linear`, Gemma's `1 + w` RMSNorm as `llama_rms_norm`). Before `apply` changes anything it runs, once
per class and kind, the class's own forward and the kind's computation on one small random input shaped from the
first such module's weight, and refuses the plan when they differ.

Invariants:
- cost: two forwards on a (2, features)-sized input (or one small image or sequence for convolutions) per class
  and kind, only for unproven pairs and only where the weights hold data (never on `meta`);
- the input comes from a private seeded generator: the caller's random state is untouched;
- the tree is not changed: the probe reads the module's own tensors under `torch.no_grad`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import protocol
from .kinds import ComputeKind

#: Largest relative difference still taken as the same computation, per dtype of the weight.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def probe(kind: ComputeKind, module: nn.Module) -> str | None:
    """What is wrong with computing `module` as `kind` (None: the same numbers, or nothing to probe on)."""
    weight = module._parameters.get("weight")
    if kind.probe is None or weight is None or weight.is_meta or not weight.is_floating_point():
        return None
    generator = torch.Generator(device=weight.device).manual_seed(0)
    with torch.no_grad():
        x = kind.probe(module, generator)
        if x is None:
            return None
        shape = tuple(x.shape)
        try:
            expected = protocol.original_class(type(module)).forward(module, x)
        except Exception as exc:  # the class cannot take what the kind takes: they are not the same operation
            return f"the class's own forward fails on the input `{kind.name}` takes (shape {shape}): {exc}"
        try:
            got = kind.compute(module, x, (weight, module._parameters.get("bias"), None))
        except Exception as exc:
            return f"`{kind.name}` fails where the class's own forward runs (input shape {shape}): {exc}"
    if not isinstance(expected, Tensor) or expected.shape != got.shape:
        found = tuple(expected.shape) if isinstance(expected, Tensor) else type(expected).__name__
        return f"`{kind.name}` gives shape {tuple(got.shape)} where the class gives {found} (input shape {shape})"
    difference = _relative_difference(got, expected)
    if difference > TOLERANCE.get(weight.dtype, 1e-5):
        return f"`{kind.name}` differs from the class's own forward by {difference:.3g} (relative, input shape {shape})"
    return None


def _relative_difference(got: Tensor, expected: Tensor) -> float:
    got, expected = got.double(), expected.double()
    scale = expected.abs().max().item()
    return (got - expected).abs().max().item() / (scale if scale > 0 else 1.0)
