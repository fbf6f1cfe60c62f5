"""Apply Streamwise Policy: convert the tree inside a MODEL that another node pack loaded."""

from __future__ import annotations

from ..runtime.hosts.comfyui import adopt
from ..runtime.plan.auto import select_policy
from ..runtime.policy.load import as_policy
from .folders import comfy_policy_dirs, policy_choices


class ApplyStreamwisePolicy:
    TITLE = "Apply Streamwise Policy"
    CATEGORY = "streamwise"
    DESCRIPTION = "Make a foreign model tree stream under ComfyUI's low-VRAM loading, by a Streamwise policy."
    FUNCTION = "apply"
    RETURN_TYPES = ("MODEL",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "policy": (policy_choices(auto=True),)}}

    def apply(self, model, policy):
        dirs = comfy_policy_dirs()
        if policy == "auto":
            policy, _ = select_policy(model.model, dirs=dirs)
        return (adopt(model, as_policy(policy, dirs=dirs)),)
