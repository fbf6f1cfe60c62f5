"""Apply Streamwise Policy: convert the tree inside a MODEL that another node pack loaded."""

from __future__ import annotations

import torch
from comfy_api.latest import io, ui

from ..runtime.convert import applied_state
from ..runtime.hosts.comfyui import adopt
from ..runtime.plan.auto import choose_policy
from .errors import NodeInputError
from .folders import (
    allow_stranded_input,
    chosen_policy,
    comfy_policy_dirs,
    policy_fingerprint,
    policy_input,
    skip_unreadable_input,
)
from .schema import schema


class ApplyStreamwisePolicy(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            category="model_patches", reports=True, aliases=("offload", "lowvram", "streaming", "vram", "policy"),
            node_id="ApplyStreamwisePolicy",
            display_name="Apply Streamwise Policy",
            description="Make a model another pack loaded stream under ComfyUI's low-VRAM loading, by a Streamwise "
                        "policy.",
            inputs=[
                io.Model.Input("model", tooltip="A MODEL from any loader (a transformers-style module tree inside)."),
                policy_input("The policy to convert by; `auto` picks by the policies' [match] tables.", auto=True),
                allow_stranded_input(),
                skip_unreadable_input(),
            ],
            outputs=[io.Model.Output("model_out", display_name="model",
                                     tooltip="The model, converted (the input stays as it was).")],
        )

    @classmethod
    def fingerprint_inputs(cls, policy: str, **_) -> str:
        """The policy's content (and of every file it extends): an edited policy converts again."""
        return policy_fingerprint(policy, comfy_policy_dirs())

    @classmethod
    def execute(cls, model, policy: str, allow_stranded: bool = False,
                skip_unreadable_policies: bool = False) -> io.NodeOutput:
        dirs = comfy_policy_dirs()
        policy = chosen_policy(policy, dirs, auto=True)
        tree = getattr(model, "model", None)
        if not isinstance(tree, torch.nn.Module):
            raise NodeInputError(f"Apply Streamwise Policy converts a MODEL holding a module tree; this input is a "
                             f"{type(model).__name__}")
        choice = choose_policy(policy, tree, dirs=dirs, skip_unreadable=skip_unreadable_policies)
        adopted = adopt(model, choice.policy, allow_stranded)
        plan = applied_state(adopted.model).plan
        text = f"{choice.reason}; {plan.render(rules=False)}"
        return io.NodeOutput(adopted, ui=ui.PreviewText(text))
