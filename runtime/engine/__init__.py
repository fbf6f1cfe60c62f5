"""Stage 3, `Plan` -> converted tree, in place: streamed leaves, relocating containers, per-tree state.

Invariants:
- checked in full before the first change; a failure restores every module exactly;
- applying the same plan again changes nothing; `revert` undoes it (not once weights are quantized);
- the engine speaks ComfyUI's low-VRAM attribute names on purpose, stated once in `protocol`.
"""

from .apply import ConversionCounts, ConversionError, applied_state, apply, apply_policy, revert

__all__ = ["ConversionCounts", "ConversionError", "applied_state", "apply", "apply_policy", "revert"]
