"""Streamwise Policy Check: validate a policy from the picker and show the report in the UI."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..runtime import check_policy, render_text
from ..runtime.policy.folders import unknown_choice
from .folders import comfy_policy_dirs, policy_fingerprint, policy_input
from .schema import schema


class StreamwisePolicyCheck(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            category="utils", aliases=("policy", "validate", "lint"),
            node_id="StreamwisePolicyCheck",
            display_name="Streamwise Policy Check",
            description="Validate a Streamwise policy (shipped or from your user folder) and show its diagnostics.",
            is_output_node=True,
            inputs=[policy_input("A shipped policy or one of yours (<user>/streamwise/policies).")],
            outputs=[io.String.Output("report", display_name="report",
                                      tooltip="The diagnostics, or that the policy is valid.")],
        )

    @classmethod
    def fingerprint_inputs(cls, policy: str) -> str:
        """The policy's content (and of every file it extends): an edited policy is checked again."""
        return policy_fingerprint(policy, comfy_policy_dirs())

    @classmethod
    def execute(cls, policy: str) -> io.NodeOutput:
        dirs = comfy_policy_dirs()
        refused = unknown_choice(policy, dirs)  # a name from the picker, never a path: no other file is read
        loaded, diagnostics = (None, [refused]) if refused else check_policy(policy, dirs=dirs)
        report = render_text(diagnostics) if diagnostics else f"policy `{policy}` is valid"
        if loaded is not None and diagnostics:
            report += f"\n\npolicy `{policy}` is valid (with warnings)"
        return io.NodeOutput(report, ui=ui.PreviewText(report))
