"""The policy folders inside ComfyUI: the user's own, then the shipped ones."""

from __future__ import annotations

from pathlib import Path

import folder_paths

from ..runtime.catalog import list_policies, policy_dirs


def comfy_policy_dirs() -> list[Path]:
    """`<ComfyUI user dir>/streamwise/policies` (created on first use) before the shipped folder."""
    user = Path(folder_paths.get_user_directory()) / "streamwise" / "policies"
    user.mkdir(parents=True, exist_ok=True)
    return policy_dirs([user])


def policy_choices() -> list[str]:
    """Re-read on every call, so edited or new user policies appear without a restart."""
    return list(list_policies(comfy_policy_dirs()))
