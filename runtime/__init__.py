"""The Streamwise engine. Importable without ComfyUI; validating a policy never imports torch."""

from .policy.diagnostics import Diagnostic, PolicyError, errors_in, render_json, render_text
from .policy.load import check_policy, load_policy

__all__ = ["Diagnostic", "PolicyError", "check_policy", "errors_in", "load_policy", "render_json", "render_text"]
