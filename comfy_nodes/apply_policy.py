"""Apply Streamwise Policy: convert the tree inside a MODEL that another node pack loaded."""

from __future__ import annotations

from comfy_api.latest import io

from ..runtime.hosts.comfyui import adopt
from ..runtime.plan.auto import choose_policy
from .folders import allow_stranded_input, chosen_policy, comfy_policy_dirs, policy_input


class ApplyStreamwisePolicy(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ApplyStreamwisePolicy",
            display_name="Apply Streamwise Policy",
            category="streamwise",
            description="Make a model another pack loaded stream under ComfyUI's low-VRAM loading, by a Streamwise "
                        "policy.",
            inputs=[
                io.Model.Input("model", tooltip="A MODEL from any loader (a transformers-style module tree inside)."),
                policy_input("The policy to convert by; `auto` picks by the policies' [match] tables.", auto=True),
                allow_stranded_input(),
            ],
            outputs=[io.Model.Output("model_out", display_name="model", tooltip="The same model, converted.")],
        )

    @classmethod
    def execute(cls, model, policy: str, allow_stranded: bool = False) -> io.NodeOutput:
        dirs = comfy_policy_dirs()
        policy = choose_policy(chosen_policy(policy, dirs, auto=True), model.model, dirs=dirs).policy
        return io.NodeOutput(adopt(model, policy, allow_stranded))
