"""The ComfyUI host: the only part of `runtime/` that imports `comfy`, and only on first use.

- `fetcher`: streamed leaves fetch through core's `cast_bias_weight` (feature-detected across core versions);
- `patcher`: `model_patcher`, `adopt` and `copied`, core's `ModelPatcher` keeping a Streamwise tree in step;
- `compile`: arming a MODEL for lazy compile through object patches (imported here: it registers the MODEL's
  compile target, so `lazy_compile` takes a MODEL wherever this host is in use);
- `reloads`: a loader node's previous model gives its host memory back before a new load is refused for it.
"""

from . import compile as _compile  # noqa: F401  (registers the MODEL's compile target)
from .fetcher import ComfyFetcher
from .patcher import adopt, copied, model_patcher
from .reloads import give_back_host_memory, load_again

__all__ = ["ComfyFetcher", "adopt", "copied", "give_back_host_memory", "load_again", "model_patcher"]
