"""The compile settings one arming uses: a policy's `[compile]` (or the converting plan's), with keyword overrides.

Invariants:
- validated in full before anything changes, with the policy format's own rules (`schemas.CompileSettings`);
- checked against the running torch: the backend must be one it ships, the mode one its inductor lists.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...schemas import CompileSettings, Policy
from ..engine import applied_state
from ..policy.load import as_policy

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
        raise TypeError(f"unknown compile setting(s): {', '.join(unknown)}")
    mode = updates.get("mode", base.mode)
    if mode not in _modes():
        raise ValueError(f"compile mode `{mode}` is not one this torch accepts: {', '.join(sorted(_modes()))}")
    fields = {**base.model_dump(by_alias=True, exclude={"blocks"}), **updates}
    settings = CompileSettings.model_validate(fields).model_copy(update={"blocks": base.blocks})
    _check_backend(settings.backend)
    return settings


def set_cache_limits(limit: int) -> None:
    """Set only the limits this torch has (their names changed across releases)."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, limit)
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))


def _modes() -> set[str]:
    from torch._inductor import list_mode_options

    return {"default", *list_mode_options()}


def _check_backend(name: str) -> None:
    import torch._dynamo  # on first use: importing it costs a second of start-up

    if name not in torch._dynamo.list_backends(exclude_tags=()):
        available = ", ".join(torch._dynamo.list_backends())
        raise ValueError(f"`{name}` is not a torch.compile backend here; available: {available}")
