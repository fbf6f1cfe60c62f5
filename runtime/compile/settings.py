"""The compile settings one arming uses: a policy's `[compile]` (or the converting plan's), with keyword overrides.

Invariants:
- validated in full before anything changes, with the policy format's own rules (`schemas.CompileSettings`);
- checked against the running torch: the backend must be one it ships and can run here (its package installed,
  CUDA for `cudagraphs`), the mode one its inductor lists.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import nn

from ...schemas import CompileSettings, Policy
from ..convert import applied_state
from ..policy.load import as_policy
from .errors import CompileError

#: `lazy_compile` keyword arguments that are not policy keys.
_NODE_NAMES = {"dynamic_shape_tracing": "dynamic"}


def compile_settings(policy: Policy | str | None, module: nn.Module, overrides: dict[str, Any]) -> CompileSettings:
    """`policy`'s `[compile]` (without one: the converting plan's, else the defaults) with `overrides` applied."""
    if policy is not None:
        base = as_policy(policy).compile
    else:
        state = applied_state(module)
        base = state.plan.compile if state is not None and state.plan is not None else CompileSettings()
    updates = {_NODE_NAMES.get(key, key): value for key, value in overrides.items()}
    unknown = sorted(set(updates) - set(CompileSettings.model_fields))
    if unknown:
        raise CompileError(f"unknown compile setting(s): {', '.join(unknown)}")
    mode = updates.get("mode", base.mode)
    if mode not in _modes():
        raise CompileError(f"compile mode `{mode}` is not one this torch accepts: {', '.join(sorted(_modes()))}")
    fields = {**base.model_dump(by_alias=True, exclude={"blocks"}), **updates}
    settings = CompileSettings.model_validate(fields).model_copy(update={"blocks": base.blocks})
    _check_backend(settings.backend)
    return settings


def cache_limits(limit: int, *, per_code: bool = True) -> dict[str, int]:
    """The dynamo config patch that holds `limit` where a compiled forward runs: the per-code limit (unless
    `torch.compile` takes it itself, as from 2.13), and the accumulated one where `limit` exceeds it, by the
    names this torch has (they changed across releases). A patch around each call, not a setting made once:
    torch 2.13 keeps config overrides per thread and context, so a limit set where a model was armed is not
    the one where its forward runs (a ComfyUI prompt's worker)."""
    import torch._dynamo

    config = torch._dynamo.config
    names = [next(name for name in (new, old) if hasattr(config, name)) for new, old in (
        ("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit"))]
    patch = {names[0]: limit} if per_code else {}
    return {**patch, names[1]: limit} if limit > getattr(config, names[1]) else patch


def _modes() -> set[str]:
    from torch._inductor import list_mode_options

    return {"default", *list_mode_options()}


def runnable_backends() -> list[str]:
    """The backends that can compile here: those torch lists whose package is installed (and `cudagraphs` only
    with CUDA), and the two debugging backends `eager` and `aot_eager`, which tell a compile problem from an
    inductor one. torch lists `tvm` and `openxla` whether or not their packages are there."""
    import torch
    import torch._dynamo

    listed = set(torch._dynamo.list_backends()) | {"eager", "aot_eager"}
    return sorted(name for name in listed if _missing(name, torch) is None)


def _missing(backend: str, torch: Any) -> str | None:
    """What `backend` lacks to compile here, or None."""
    package = _BACKEND_PACKAGES.get(backend)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"the `{package}` package, which is not installed"
    if backend == "cudagraphs" and not torch.cuda.is_available():
        return "CUDA, which this machine does not have"
    return None


#: The package a backend torch lists imports when it compiles.
_BACKEND_PACKAGES = {"tvm": "tvm", "openxla": "torch_xla"}


def _check_backend(name: str) -> None:
    import torch
    import torch._dynamo  # on first use: importing it costs a second of start-up

    if name not in torch._dynamo.list_backends(exclude_tags=()):
        available = ", ".join(runnable_backends())
        raise CompileError(f"`{name}` is not a torch.compile backend here; available: {available}")
    missing = _missing(name, torch)
    if missing is not None:
        raise CompileError(f"backend `{name}` needs {missing}; available here: {', '.join(runnable_backends())}")
