"""A user short of memory: a real ComfyUI server inside a memory cgroup whose limit leaves the model only a quarter
of its size beyond what the idle server holds. The loader's default host budget reads the limit, keeps what does
not fit in the file, and Generate Text gives transformers' text; the server is never killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import torch

from helpers import REPO, memory_cgroup, module_from_file

server_module = module_from_file(Path(__file__).with_name("test_server.py"))
PROMPT = server_module.PROMPT


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
        expected = server_module.reference_text(folder, PROMPT, 8)
        paths = base / "extra_model_paths.yaml"
        paths.write_text(f"streamwise_tests:\n  base_path: {base}\n  streamwise: models/streamwise\n"
                         "  custom_nodes: custom_nodes\n")
        port = server_module.free_port()
        command = [sys.executable, str(server_module.LAUNCHER), str(comfy_root), "--cpu", "--listen", "127.0.0.1",
                   "--port", str(port), "--extra-model-paths-config", str(paths),
                   *server_module.core_arguments(comfy_root, base)]
        with open(base / "server.log", "w") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=os.environ.copy(), start_new_session=True, preexec_fn=cgroup.enter)
        server = server_module.Server(process, port, base)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert process.poll() is None, f"the server exited with {process.returncode}\n{server.tail()}"
                assert time.monotonic() < deadline, f"the server did not answer within 300 s\n{server.tail()}"
                try:
                    server.request("/system_stats")
                    break
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.5)
            limit = cgroup.usage() + size // 4  # the idle server, and a quarter of the model
            cgroup.limit(limit)
            graph = server_module.workflow("streamwise_generate_text")
            graph["1"]["inputs"]["model"] = "streamwise/larger-qwen2"
            entry = server.wait(server.queue(graph), timeout=300)
            assert process.poll() is None, f"the server was killed ({process.returncode})\n{server.tail()}"
            assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-3000:]
            assert entry["outputs"]["2"]["text"] == [expected]
            (report,) = entry["outputs"]["1"]["text"]
            assert ", file " in report, report  # most of it stayed in the file
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
