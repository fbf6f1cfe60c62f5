"""Moved: the conversion verb is `runtime.convert` (`apply`, `apply_policy`, `check`, `revert`), its state
`runtime.convert.state`. This module re-exports them for one release, so `streamwise.runtime.engine.apply` imports keep
working; the import-direction test lists it as the one exemption."""

from ..convert.apply import apply, apply_policy, check, revert
from ..convert.state import AppliedState, ConversionCounts, ConversionError, applied_state

__all__ = ["AppliedState", "ConversionCounts", "ConversionError", "applied_state", "apply", "apply_policy", "check",
           "revert"]
