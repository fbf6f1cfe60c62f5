"""The repository root is both the pip package `streamwise` and a ComfyUI custom-node pack."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from helpers import REPO, TESTS, write_policy


def run_python(code: str, *paths) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "STREAMWISE_POLICY_PATH"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)


def test_plain_import_is_light_and_registers_no_nodes():
    result = run_python("""
        import sys, streamwise
        assert not hasattr(streamwise, "comfy_entrypoint")
        heavy = {"torch", "folder_paths", "comfy"} & set(sys.modules)
        assert not heavy, heavy
    """)
    assert result.returncode == 0, result.stderr


def test_a_bare_import_of_the_root_file_raises_nothing():
    """pytest imports a checkout's `__init__.py` on its own when the folder name is no identifier."""
    result = run_python(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("__init__", {str(REPO / "__init__.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.__all__ == []
    """)
    assert result.returncode == 0, result.stderr


def test_loaded_as_a_custom_node_pack_under_its_folder_name(tmp_path):
    """What ComfyUI's loader does: import the folder as a package named after the folder, here with no `streamwise`
    installed, as a user who cloned the pack into custom_nodes has it.

    `folder_paths`, `comfy` and `comfy_api.latest` here are minimal stand-ins; tests/comfy/ runs the real loader.
    """
    fake = tmp_path / "fake_comfyui"
    (fake / "comfy").mkdir(parents=True)
    (fake / "comfy" / "__init__.py").write_text("")
    user = tmp_path / "user"
    (fake / "folder_paths.py").write_text(f"def get_user_directory():\n    return {str(user)!r}\n")
    policies = user / "streamwise" / "policies"
    policies.mkdir(parents=True)
    write_policy(policies, "my-llm", 'extends = "decoder-llm"\n\n[compile]\nmode = "turbo"\n')
    result = run_python(f"""
        import asyncio, importlib.util, sys
        from comfy_harness import Uninstalled, stand_in_comfy_api
        sys.meta_path.insert(0, Uninstalled("streamwise"))
        sys.modules["comfy_api.latest"] = stand_in_comfy_api()
        spec = importlib.util.spec_from_file_location(
            "ComfyUI-Streamwise", {str(REPO / "__init__.py")!r}, submodule_search_locations=[{str(REPO)!r}])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pack
        spec.loader.exec_module(pack)

        async def listed():
            return await (await pack.comfy_entrypoint()).get_node_list()

        nodes = {{node.__name__: node for node in asyncio.run(listed())}}  # the node ids: tests/comfy/test_server.py
        assert sorted(nodes) == [
            "ApplyStreamwisePolicy", "QuantizedLazyTorchCompile", "StreamwiseGenerateSpeech", "StreamwiseGenerateText",
            "StreamwiseModelLoader", "StreamwisePolicyCheck",
        ]
        node = nodes["StreamwisePolicyCheck"]
        schema = node.define_schema().kwargs
        assert (schema["node_id"], schema["display_name"]) == ("StreamwisePolicyCheck", "Streamwise Policy Check")
        (policy,) = schema["inputs"]
        choices = policy.kwargs["options"]
        assert choices == ["any-module", "decoder-llm", "my-llm", "transformers", "vibevoice"], choices
        ok = node.execute("vibevoice").args
        assert ok == ("policy `vibevoice` is valid",), ok
        (bad,) = node.execute("my-llm").args
        assert "error[invalid-value]" in bad and "my-llm.toml:8:8" in bad, bad

        # Below the folder ComfyUI named, the pack is `streamwise`: so are the errors' types ComfyUI shows.
        assert sys.modules["streamwise"].__file__ == {str(REPO / "__init__.py")!r}
        try:
            nodes["ApplyStreamwisePolicy"].execute(None, "../../secret")
        except Exception as error:
            shown = f"{{type(error).__module__}}.{{type(error).__qualname__}}"
        assert shown == "streamwise.runtime.policy.diagnostics.PolicyError", shown
    """, fake, TESTS)
    assert result.returncode == 0, result.stderr


def test_wheel_carries_the_package_policies_and_schema(tmp_path):
    """Built from a copy of the checkout: a `build/` left behind by an older layout must not fill the wheel's gaps."""
    source = tmp_path / "src"
    litter = shutil.ignore_patterns("*.egg-info", ".git", ".venv*", "__pycache__", ".*_cache", ".hypothesis",
                                    ".benchmarks")

    def ignored(folder: str, names: list[str]) -> set[str]:  # `build/`, `dist/` at the top only
        top = {"build", "dist"} & set(names) if Path(folder) == REPO else set()
        return set(litter(folder, names)) | top

    shutil.copytree(REPO, source, ignore=ignored)
    inits = (p.relative_to(source) for p in source.glob("*/**/__init__.py"))
    packages = sorted(p.as_posix() for p in inits if p.parts[0] not in ("tests", "benchmarks", "examples"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    build = subprocess.run([*command, str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("streamwise-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [p for p in packages if f"streamwise/{p}" not in names] == []  # pyproject lists every package
    for expected in (
        "streamwise/__init__.py",
        "streamwise/runtime/cli/policy_validate.py",
        "streamwise/runtime/policy/load.py",
        "streamwise/schemas/policy.py",
        "streamwise/schemas/policy.v1.schema.json",
        "streamwise/policies/vibevoice.toml",
        "streamwise/policies/decoder-llm.toml",
        "streamwise/policies/_template.toml",
        "streamwise/comfy_nodes/policy_check.py",
    ):
        assert expected in names
    assert not any(name.startswith(("streamwise/tests", "tests/", "streamwise/benchmarks")) for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    entry_point = "policy-validate = streamwise.runtime.cli.policy_validate:main"
    assert entry_point in zipfile.ZipFile(wheel).read(entry_points).decode()
