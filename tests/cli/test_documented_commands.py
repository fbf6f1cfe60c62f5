"""The command lines the README and `docs/` show, run as written: the pack's commands from a ComfyUI-like folder, the
installed commands (`streamwise`, `policy-validate`) from an empty one. Installs and test suites are not run here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import REPO, tiny_qwen2, tiny_tokenizer

PACK = "custom_nodes/ComfyUI-Streamwise"


INSTALLED = ("streamwise", "policy-validate")


def documented_lines(*documents) -> list[str]:
    """Every line of a bash block in the given documents (paths under the repository)."""
    lines = []
    for document in documents:
        text = (REPO / document).read_text(encoding="utf-8")
        blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
        lines += [line.strip() for block in blocks for line in block.splitlines()]
    return lines


def documented_pack_commands() -> list[str]:
    """Every line of a bash block in the README that runs the pack's folder."""
    return [line for line in documented_lines("README.md") if line.startswith(f"python {PACK}")]


def run_as_written(command: str, cwd, executable: str) -> None:
    argv = shlex.split(command.split("#")[0])
    done = subprocess.run([executable, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"


def test_the_readmes_pack_commands_run_as_written(tmp_path):
    commands = documented_pack_commands()
    assert len(commands) >= 3 and any(" quantize " in c for c in commands)
    (tmp_path / "custom_nodes").mkdir()
    (tmp_path / PACK).symlink_to(REPO, target_is_directory=True)
    model = tmp_path / "models" / "LLM" / "my-model"  # the folder the README's quantize line names
    tiny_qwen2().save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    for command in commands:
        run_as_written(command, tmp_path, sys.executable)
    assert (tmp_path / "models" / "LLM" / "my-model.Q4_0.gguf").is_file()
    assert (tmp_path / "models" / "streamwise" / "tiny-qwen2" / "config.json").is_file()


def test_the_docs_installed_commands_run_as_written(tmp_path):
    documents = ["README.md", *(path.relative_to(REPO) for path in sorted((REPO / "docs").glob("*.md")))]
    commands = [line for line in documented_lines(*documents) if line.split(" ", 1)[0] in INSTALLED]
    assert any(command.startswith("streamwise policy draft") for command in commands)
    bin_folder = Path(sys.executable).parent  # the environment's own scripts, as `pip install` put them there
    for command in commands:
        run_as_written(command, tmp_path, str(bin_folder / command.split(" ", 1)[0]))
