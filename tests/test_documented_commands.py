"""The command lines the README shows for a ComfyUI install, run as written from a ComfyUI-like folder."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from helpers import REPO, tiny_qwen2, tiny_tokenizer

PACK = "custom_nodes/ComfyUI-Streamwise"


def documented_pack_commands() -> list[str]:
    """Every line of a bash block in the README that runs the pack's folder."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(f"python {PACK}")]


def test_the_readmes_pack_commands_run_as_written(tmp_path):
    commands = documented_pack_commands()
    assert len(commands) >= 3 and any(" quantize " in c for c in commands)
    (tmp_path / "custom_nodes").mkdir()
    (tmp_path / PACK).symlink_to(REPO, target_is_directory=True)
    model = tmp_path / "models" / "LLM" / "my-model"  # the folder the README's quantize line names
    tiny_qwen2().save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    for command in commands:
        argv = shlex.split(command.split("#")[0])
        done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "models" / "LLM" / "my-model.Q4_0.gguf").is_file()
    assert (tmp_path / "models" / "streamwise" / "tiny-qwen2" / "config.json").is_file()
