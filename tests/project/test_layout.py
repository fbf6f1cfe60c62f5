"""The layout is the pipeline, and ComfyUI's names live only where ComfyUI is the subject."""

from __future__ import annotations

import ast
import re

from helpers import REPO

RUNTIME = REPO / "runtime"
STAGES = {"policy", "plan", "engine", "quant", "builders", "convert", "checkpoint", "compile", "hosts", "generation",
          "cli"}
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


#: The floors, lowest first: a module imports only from its own floor and the ones below. `load_pretrained` is the
#: checkpoint stage's (it builds, converts and loads); generation runs a converted tree beside the hosts.
FLOORS = {
    "errors": 0, "schemas": 0, "runtime.sizes": 0, "runtime.registry": 0, "runtime.host_memory": 0,
    "runtime.policy": 1, "runtime.engine": 1, "runtime": 1,  # the package's own __init__: the policy API
    "runtime.plan": 2, "runtime.quant": 2, "runtime.builders": 2,
    "runtime.convert": 3,
    "runtime.checkpoint": 4, "runtime.compile": 4,
    "runtime.hosts": 5, "runtime.generation": 5,
    "runtime.cli": 6, "comfy_nodes": 6,
}


def floor(module: str) -> int | None:
    found = [(len(prefix), level) for prefix, level in FLOORS.items()
             if module == prefix or module.startswith(prefix + ".")]
    return max(found)[1] if found else None


def imported(path, package: list[str]):
    """Every module `path` imports from the package, at the top, inside functions and under TYPE_CHECKING alike."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            if node.module:
                yield ".".join([*base, node.module]), node.lineno
            else:
                yield from ((".".join([*base, alias.name]), node.lineno) for alias in node.names)


def test_imports_only_go_down():
    up = []
    for path in sorted([*RUNTIME.rglob("*.py"), *(REPO / "schemas").rglob("*.py"), *(REPO / "comfy_nodes").glob("*.py"),
                        REPO / "errors.py"]):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        package = parts[:-1]
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        assert floor(module) is not None, f"{module} is on no floor: add it to FLOORS"
        up += [f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)}), line {line}"
               for target, line in imported(path, package) if (floor(target) or 0) > floor(module)]
    assert up == []


def test_tests_hold_one_folder_per_stage_and_pytest_walks_every_one():
    """tests/<stage>/ for each stage (project-wide checks in tests/project/, a real core's in tests/comfy/); pytest's
    `norecursedirs` must pass over none of them (its default leaves out any folder named `build`, which is why no
    stage is named so: ruff and black skip such a folder too)."""
    import fnmatch

    import tomllib

    tests = REPO / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders == STAGES | {"project", "comfy"}
    assert [p.name for p in tests.glob("test_*.py")] == []  # every test lives in its stage's folder
    pytest_defaults = ["*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}"]
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    skipped = options.get("norecursedirs", pytest_defaults)
    assert [name for name in folders if any(fnmatch.fnmatch(name, pattern) for pattern in skipped)] == []
