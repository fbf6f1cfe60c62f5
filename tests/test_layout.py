"""The layout is the pipeline, and ComfyUI's names live only where ComfyUI is the subject."""

from __future__ import annotations

import re

from helpers import REPO

RUNTIME = REPO / "runtime"
STAGES = {"policy", "plan", "engine", "quant", "checkpoint", "compile", "hosts", "generation", "cli"}
#: ComfyUI's protocol attributes, MODEL internals and modules.
COMFYUI_NAMES = re.compile(
    r"comfy_cast_weights|\bweight_function\b|\bbias_function\b|comfy_patched_weights|_comfy_model_dtype"
    r"|object_patch|ModelPatcher|LowVramPatch|cast_bias_weight|transformer_options|folder_paths"
    r"|^\s*(?:import|from) comfy\b",
    re.MULTILINE,
)
ALLOWED = (RUNTIME / "hosts" / "comfyui", RUNTIME / "engine" / "protocol.py")


def test_runtime_holds_one_package_per_stage():
    packages = {p.name for p in RUNTIME.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.name for p in RUNTIME.glob("*.py")}
    # beside the stages, the leaf utilities every stage may use: sizes, what the host can still allocate, registries
    assert packages == STAGES and modules == {"__init__.py", "host_memory.py", "registry.py", "sizes.py"}


def test_only_the_comfyui_host_and_the_protocol_know_comfyuis_names():
    leaks = []
    for path in sorted([*RUNTIME.rglob("*.py"), *(REPO / "schemas").rglob("*.py")]):
        if any(path == allowed or allowed in path.parents for allowed in ALLOWED):
            continue
        code = re.sub(r'"""(?:.|\n)*?"""|#.*', "", path.read_text(encoding="utf-8"))  # prose may name ComfyUI
        leaks += [f"{path.relative_to(REPO)}: {m.group(0).strip()}" for m in COMFYUI_NAMES.finditer(code)]
    assert leaks == []


def test_every_streamwise_marker_is_spelled_in_the_protocol_alone():
    """`_sw_*` attribute names (and the root state's) are written once, in engine/protocol.py; code uses the names."""
    spelled = []
    for path in sorted([*RUNTIME.rglob("*.py"), *(REPO / "comfy_nodes").rglob("*.py")]):
        if path == RUNTIME / "engine" / "protocol.py":
            continue
        code = re.sub(r'"""(?:.|\n)*?"""|#.*', "", path.read_text(encoding="utf-8"))
        spelled += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in re.finditer(r"\b_sw_\w+|\"_streamwise\"", code)]
    assert spelled == []
