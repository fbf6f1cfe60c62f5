"""The ComfyUI host: the only place in `runtime/` that imports `comfy`, and only on first use."""

from .patcher import ComfyFetcher, adopt, model_patcher

__all__ = ["ComfyFetcher", "adopt", "model_patcher"]
