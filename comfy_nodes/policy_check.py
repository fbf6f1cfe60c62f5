"""Streamwise Policy Check: validate a policy from the picker and show the report in the UI."""

from __future__ import annotations

from ..runtime import check_policy, render_text
from ..runtime.policy.folders import unknown_choice
from .folders import comfy_policy_dirs, policy_choices


class StreamwisePolicyCheck:
    TITLE = "Streamwise Policy Check"
    CATEGORY = "streamwise"
    DESCRIPTION = "Validate a Streamwise policy (shipped or from your user folder) and show its diagnostics."
    FUNCTION = "check"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"policy": (policy_choices(), {"tooltip": "A shipped policy or one of yours."})}}

    @classmethod
    def IS_CHANGED(cls, policy):
        """Always re-check: any file of the policy's `extends` chain may have changed, and checking is cheap."""
        return float("nan")

    def check(self, policy):
        dirs = comfy_policy_dirs()
        refused = unknown_choice(policy, dirs)  # a name from the picker, never a path: no other file is read
        loaded, diagnostics = (None, [refused]) if refused else check_policy(policy, dirs=dirs)
        report = render_text(diagnostics) if diagnostics else f"policy `{policy}` is valid"
        if loaded is not None and diagnostics:
            report += f"\n\npolicy `{policy}` is valid (with warnings)"
        return {"ui": {"text": [report]}, "result": (report,)}
