"""Stage 2, `Policy` x live tree -> `Plan`: what the policy does to each module, decided before any change.

Invariants:
- pure: reads `named_modules()` and tensor sizes (meta tensors work), changes nothing;
- a policy is matched by names only (class names, paths), so resolving imports nothing.
"""

from .auto import plan_for
from .plan import Coverage, ModulePlan, Plan, TensorRef
from .resolve import resolve

__all__ = ["Coverage", "ModulePlan", "Plan", "TensorRef", "plan_for", "resolve"]
