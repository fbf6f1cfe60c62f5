"""Apply Streamwise Policy: convert the tree inside a MODEL that another node pack loaded."""

from __future__ import annotations

from ..runtime.hosts.comfyui import adopt
from ..runtime.plan.auto import choose_policy
from .folders import chosen_policy, comfy_policy_dirs, policy_choices


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
        policy, _ = choose_policy(chosen_policy(policy, dirs, auto=True), model.model, dirs=dirs)
        return (adopt(model, policy),)
