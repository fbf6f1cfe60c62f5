"""The folders the nodes read inside ComfyUI: user policies before shipped ones, and model folders."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ..runtime.policy.diagnostics import PolicyError, render_text
from ..runtime.policy.folders import list_policies, policy_dirs, unknown_choice
from ..runtime.policy.load import check_policy

MODEL_FOLDERS = ("streamwise", "text_encoders", "LLM")  # ComfyUI folder keys the model loader reads
REGISTERED_FOLDERS = ("streamwise", "LLM")  # no core registers these: added as models/<key> when absent


def comfy_policy_dirs() -> list[Path]:
    """`<ComfyUI user dir>/streamwise/policies` (created on first use) before the shipped folder."""
    user = Path(folder_paths.get_user_directory()) / "streamwise" / "policies"
    user.mkdir(parents=True, exist_ok=True)
    return policy_dirs([user])


def policy_input(tooltip: str, *, auto: bool = False) -> io.Combo.Input:
    """The policy picker, re-read whenever ComfyUI asks for a node's schema, so edited or new user policies appear
    without a restart."""
    choices = (["auto"] if auto else []) + list(list_policies(comfy_policy_dirs()))
    return io.Combo.Input("policy", options=choices, tooltip=tooltip)


def allow_stranded_input() -> io.Boolean.Input:
    """The opt-in to a plan that strands tensors."""
    return _opt_in("allow_stranded", "Accept a policy that leaves some tensors to no rule. Off: such a plan is refused "
                                     "with the classes it strands and the rule that would cover them, since a partial "
                                     "load onto the GPU would crash on them.")


def skip_unreadable_input() -> io.Boolean.Input:
    """The opt-in to `auto` choosing while some policy file cannot be read."""
    return _opt_in("skip_unreadable_policies", "Let `auto` choose while a policy file in the folders does not parse "
                                               "or validate; the report names each one skipped. Off: such a file "
                                               "fails the run with its error, since it may be the one meant for this "
                                               "model.")


def _opt_in(name: str, tooltip: str) -> io.Boolean.Input:
    """An opt-in, off by default and optional, so saved workflows without it still run."""
    return io.Boolean.Input(name, default=False, optional=True, tooltip=tooltip)


def policy_fingerprint(policy: str, dirs: list[Path]) -> str:
    """What a node that reads `policy` depends on: the merged content of the policy (every file of its `extends`
    chain), or for `auto` of every policy it chooses among; its diagnostics where it does not load. A node's
    fingerprint includes it, so an edited policy re-runs the node and an unchanged one stays cached."""
    names = list(list_policies(dirs)) if policy == "auto" else [policy]
    parts = []
    for name in names:
        loaded, diagnostics = check_policy(name, dirs=dirs)
        parts.append(loaded.model_dump_json() if loaded is not None else render_text(diagnostics))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def chosen_policy(policy: object, dirs: list[Path], *, auto: bool = False) -> str:
    """`policy` when the picker over `dirs` offers it; otherwise a `PolicyError` that quotes no file."""
    refused = unknown_choice(policy, dirs, auto=auto)
    if refused is not None:
        raise PolicyError([refused])
    return policy


def model_roots() -> dict[str, list[str]]:
    """The paths of each of `MODEL_FOLDERS`; `streamwise` and `LLM` are registered on first use (another pack or
    extra_model_paths.yaml may have registered them already), so models/LLM is read as the tooltip says."""
    for key in REGISTERED_FOLDERS:
        if key not in folder_paths.folder_names_and_paths:
            folder_paths.add_model_folder_path(key, os.path.join(folder_paths.models_dir, key))
    roots = {}
    for key in MODEL_FOLDERS:
        if key in folder_paths.folder_names_and_paths:
            roots[key] = folder_paths.get_folder_paths(key)
    return roots
