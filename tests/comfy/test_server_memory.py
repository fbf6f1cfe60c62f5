"""A user short of memory: a real ComfyUI server inside a memory cgroup whose limit leaves the model only a quarter
of its size beyond what the idle server holds. The loader's default host budget reads the limit, keeps what does
not fit in the file, and Generate Text gives transformers' text; the server is never killed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from helpers import REPO, memory_cgroup, module_from_file

server_module = module_from_file(Path(__file__).with_name("test_server.py"))


def _larger_model(models: Path) -> tuple[Path, int]:
    """A ~480 MiB Qwen2 beside the example model, with its tokenizer; its folder and the bytes of its weights."""
    import transformers

    tiny = models / "streamwise" / "tiny-qwen2"
    folder = models / "streamwise" / "larger-qwen2"
    known = json.loads((tiny / "config.json").read_text())
    config = transformers.Qwen2Config(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=known["vocab_size"], tie_word_embeddings=False,
        **{key: known.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    for path in tiny.iterdir():
        if not path.name.startswith(("model", "config")):
            shutil.copy(path, folder / path.name)
    return folder, sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def test_a_model_larger_than_the_memory_left_generates_under_the_limit(comfy_root, tmp_path):
    with memory_cgroup() as cgroup:
        base = tmp_path / "base"
        (base / "custom_nodes").mkdir(parents=True)
        (base / "custom_nodes" / server_module.PACK).symlink_to(REPO, target_is_directory=True)
        command = [sys.executable, str(base / "custom_nodes" / server_module.PACK), "example-models",
                   str(base / "models")]
        assert subprocess.run(command, capture_output=True, timeout=300).returncode == 0
        folder, size = _larger_model(base / "models")
        graph = server_module.workflow("streamwise_generate_text")
        graph["1"]["inputs"]["model"] = "streamwise/larger-qwen2"
        expected = server_module.expected_text(folder, graph)
        paths = base / "extra_model_paths.yaml"
        paths.write_text(f"streamwise_tests:\n  base_path: {base}\n  streamwise: models/streamwise\n"
                         "  custom_nodes: custom_nodes\n")
        with server_module.launched(comfy_root, base, paths, preexec_fn=cgroup.enter) as server:
            limit = cgroup.usage() + size // 4  # the idle server, and a quarter of the model
            cgroup.limit(limit)
            entry = server.wait(server.queue(graph), timeout=300)
            killed = server.process.poll()
            assert killed is None, f"the server was killed ({killed})\n{server.tail()}"
            assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-3000:]
            assert entry["outputs"]["2"]["text"] == [expected]
            (report,) = entry["outputs"]["1"]["text"]
            assert ", file " in report, report  # most of it stayed in the file
