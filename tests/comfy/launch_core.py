"""Run a ComfyUI core's main.py with torchvision/torchaudio stubbed, as tests/comfy_harness.py does in process:
main.py imports them, and installing them beside a CPU torch would replace that torch. An installed `streamwise` is
hidden: the server sees the pack as a user who cloned it into custom_nodes has it, a folder and nothing else.

    python tests/comfy/launch_core.py /path/to/ComfyUI --cpu --listen 127.0.0.1 --port 8188
"""

import os
import runpy
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # tests/, not this folder: its names must not shadow core's
import transformers  # noqa: E402, F401  (before the stub: transformers probes torchvision)

from comfy_harness import Uninstalled, _StubFinder  # noqa: E402

root = Path(sys.argv[1]).resolve()
sys.meta_path[:0] = [_StubFinder(), Uninstalled("streamwise")]
sys.path[0] = str(root)
os.chdir(root)
sys.argv = [str(root / "main.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
