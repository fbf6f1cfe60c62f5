"""Building a model in a dtype without changing torch's default dtype for the process.

`torch.set_default_dtype` is process-wide: a model built in bfloat16 that way turns every tensor made meanwhile by
another thread into bfloat16 too (transformers' `from_config(dtype=...)` does exactly that). `building_in` scopes
the same effect to the calling thread: a torch function mode (whose stack is per thread) for the tensors made,
and `torch.get_default_dtype` answering the build dtype in this thread (model code reads it: Musicgen casts its
position table to it).

Invariants:
- a tensor takes `dtype` exactly where it would have taken the default dtype: a constructor given no dtype that
  makes floats, or an operation on no floating tensor, without a dtype of its own, that makes floats
  (`torch.arange(8) / 8`);
- a tensor made in float32 on purpose (`.float()`, an explicit `dtype=`: rotary `inv_freq`) stays float32, where
  casting the built model would round it;
- torch's default dtype is never changed; only this thread's `torch.get_default_dtype()` answers otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .scoped import ContextPatch

# The dtypes torch can build a model in (its default dtype), so the only ones a skeleton can have.
BUILD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@contextmanager
def building_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Make tensors in `dtype` (one of `BUILD_DTYPES`, or None: the default) where they would take the default
    dtype, in this thread only."""
    if dtype is None or dtype == torch.get_default_dtype():
        yield
        return
    with _DefaultDtype(dtype), _DEFAULT_DTYPE.active(dtype):
        yield


def _answering(get_default_dtype: Callable[[], torch.dtype], building: Callable[[], torch.dtype | None]) -> Callable:
    def get_default() -> torch.dtype:
        return building() or get_default_dtype()

    return get_default


_DEFAULT_DTYPE = ContextPatch(torch, "get_default_dtype", _answering)


class _DefaultDtype(TorchFunctionMode):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.default = torch.get_default_dtype()  # before this thread's answer changes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") is not None or func in _CONVERSIONS:
            return func(*args, **kwargs)
        if func in _FLOAT_CONSTRUCTORS:
            return func(*args, **{**kwargs, "dtype": self.dtype})
        result = func(*args, **kwargs)
        if not isinstance(result, Tensor) or result.dtype != self.default:
            return result
        if func in _CONSTRUCTORS:
            return func(*args, **{**kwargs, "dtype": self.dtype})  # made again: no value rounded twice
        if not any(isinstance(x, Tensor) and x.is_floating_point() for x in (*args, *kwargs.values())):
            return result.to(self.dtype)
        return result


# Constructors that make floats unless told a dtype, and those whose dtype follows their arguments.
_FLOAT_CONSTRUCTORS = frozenset({
    torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.rand, torch.randn, torch.eye, torch.linspace,
    torch.logspace, torch.scalar_tensor, torch.bartlett_window, torch.blackman_window, torch.hamming_window,
    torch.hann_window, torch.kaiser_window,
})
_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.arange, torch.range, torch.full})
# Conversions name their dtype themselves (`.float()` is float32 on purpose).
_CONVERSIONS = frozenset({Tensor.to, Tensor.type, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16})
