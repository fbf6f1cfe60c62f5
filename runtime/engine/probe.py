"""The numerical probe: a specific kind named exactly for a class it is not proven for is checked on real weights.

`kinds.fit` proves what it can from the class alone (the kind was made for it, or its forward is a verbatim copy)
and gives look-alikes their own forward; a rule that names a class or module exactly with a specific kind claims
the kind computes it (GPT-2's transposed `Conv1D` as `linear` does not, nor Gemma's `1 + w` RMSNorm as
`llama_rms_norm`). Before `apply` changes anything, the claim is checked: the class's own forward and the kind's
computation run on the same small inputs and must agree within a few ulp.

Invariants:
- what it covers: every distinct configuration of the class's modules (`configuration`: their plain attributes,
  tensor shapes and dtypes, and each direct tensor the kind does not read, whose values may matter), every input
  rank a model feeds such a layer, at two magnitudes (an `eps` placed otherwise shows at small ones), computed in
  float32 (float64 weights stay float64) on the module's own device;
- cost: two forwards per input (4 ranks x 2 magnitudes of a (2, 3, features)-sized input at most) per
  configuration, only for named unproven pairs and only where the weights hold data (never on `meta`);
- the input comes from a private seeded generator: the caller's random state is untouched;
- the tree is not changed: float32 copies shadow the module's tensors for the call, under `torch.no_grad`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from . import file_tier, protocol
from .kinds import ComputeKind

#: How far the kind may be from the class's own forward, in units of the computing dtype's epsilon, relative to the
#: largest output: a few ulp, room for a reordered sum and nothing else.
ULPS = 4
MAGNITUDES = (1.0, 1e-3)


def probe(kind: ComputeKind, module: nn.Module) -> str | None:
    """What is wrong with computing `module` as `kind` (None: the same numbers, or nothing to probe on)."""
    weight = module._parameters.get("weight")
    if kind.probe is None or weight is None or not file_tier.in_memory(weight) or not weight.is_floating_point():
        return None
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    generator = torch.Generator(device=weight.device).manual_seed(0)
    with torch.no_grad(), _computing_in(module, dtype):
        inputs = kind.probe(module, generator)
        for x in inputs or ():
            for scaled, magnitude in _at_magnitudes(x):
                problem = _compare(kind, module, scaled, magnitude)
                if problem is not None:
                    return problem
    return None


def _at_magnitudes(x: Tensor) -> list[tuple[Tensor, float]]:
    """`x` at each probed magnitude; an integer input (indices) only as it is, never made float."""
    if not x.is_floating_point():
        return [(x, 1.0)]
    return [(x * magnitude, magnitude) for magnitude in MAGNITUDES]


def configuration(kind: ComputeKind, module: nn.Module) -> tuple:
    """What can make two modules of one class compute differently under `kind`: one probe per distinct value."""
    plain = tuple(sorted(((name, value) for name, value in module.__dict__.items() if _plain(value)),
                         key=lambda item: item[0]))
    tensors = tuple((name, tuple(tensor.shape), tensor.dtype, None if name in kind.requires else id(tensor))
                    for slots in (module._parameters, module._buffers) for name, tensor in slots.items()
                    if tensor is not None)
    return plain, tensors


def _plain(value: object) -> bool:
    """A value a forward may branch on that is compared by value (flags, sizes, eps, names)."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return value is None or isinstance(value, (bool, int, float, str))


def _compare(kind: ComputeKind, module: nn.Module, x: Tensor, magnitude: float) -> str | None:
    shape = f"input shape {tuple(x.shape)}" + (f" at magnitude {magnitude:g}" if magnitude != 1.0 else "")
    try:
        expected = protocol.original_class(type(module)).forward(module, x)
    except Exception as exc:  # the class cannot take what the kind takes: they are not the same operation
        return f"the class's own forward fails on the input `{kind.name}` takes ({shape}): {exc}"
    try:
        got = kind.compute(module, x, (module.weight, getattr(module, "bias", None), None))
    except Exception as exc:
        return f"`{kind.name}` fails where the class's own forward runs ({shape}): {exc}"
    if not isinstance(expected, Tensor) or expected.shape != got.shape:
        found = tuple(expected.shape) if isinstance(expected, Tensor) else type(expected).__name__
        return f"`{kind.name}` gives shape {tuple(got.shape)} where the class gives {found} ({shape})"
    difference = _relative_difference(got, expected)
    allowed = ULPS * torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
    if difference > allowed:
        return (f"`{kind.name}` differs from the class's own forward by {difference:.3g} (relative, {shape}; "
                f"allowed {allowed:.2g})")
    return None


@contextmanager
def _computing_in(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """`module`'s floating direct tensors as `dtype` copies for the duration (shadows in the instance dictionary,
    where attribute lookup finds them before `nn.Module.__getattr__`)."""
    shadows = {name: tensor.to(dtype) for slots in (module._parameters, module._buffers)
               for name, tensor in slots.items() if tensor is not None and tensor.is_floating_point()}
    held = module.__dict__
    held.update(shadows)
    try:
        yield
    finally:
        for name in shadows:
            del held[name]


def _relative_difference(got: Tensor, expected: Tensor) -> float:
    got, expected = got.double(), expected.double()
    scale = expected.abs().max().item()
    return (got - expected).abs().max().item() / (scale if scale > 0 else 1.0)
