"""3. Plan -> converted tree: `apply` a plan (or `apply_policy`) in place, `check` it first, `revert` it. Above the
stages it uses: the plan, the quant formats and the engine's leaf machinery; `state` is what a converted root keeps,
and `unconverted_copy` a tree to convert that leaves its source as it was (for hosts that must not change an input).
"""

from .apply import apply, apply_policy, check, revert
from .copies import unconverted_copy
from .state import AppliedState, ConversionCounts, ConversionError, applied_state

__all__ = ["AppliedState", "ConversionCounts", "ConversionError", "applied_state", "apply", "apply_policy", "check",
           "revert", "unconverted_copy"]
