"""Stage 1, policy file -> validated `Policy`: reading, locating, migrating, validating and `extends`.

Invariants:
- never imports torch, nor any module a policy names (a policy is data; a test proves it);
- every problem is a located `Diagnostic`; `load_policy` raises them together as a `PolicyError`.
"""

from .diagnostics import Diagnostic, Location, PolicyError, errors_in, render_json, render_text
from .load import check_policy, load_policy

__all__ = [
    "Diagnostic", "Location", "PolicyError", "check_policy", "errors_in", "load_policy", "render_json", "render_text",
]
