from __future__ import annotations

import pytest

from comfy_harness import ROOT_ENV, boot, comfyui_root


@pytest.fixture(scope="session")
def comfy_root():
    """The ComfyUI checkout at $COMFYUI_ROOT; the tests that need one skip without it."""
    root = comfyui_root()
    if root is None:
        pytest.skip(f"{ROOT_ENV} is not set: point it at a ComfyUI checkout to run the integration tests")
    return root


@pytest.fixture(scope="session")
def comfy_nodes(comfy_root, tmp_path_factory):
    """ComfyUI's `nodes` module from the core at $COMFYUI_ROOT, imported into this process."""
    root = comfy_root
    import transformers  # noqa: F401  (before the torchvision stub exists: transformers probes torchvision)

    return boot(root, tmp_path_factory.mktemp("comfy-user"))
