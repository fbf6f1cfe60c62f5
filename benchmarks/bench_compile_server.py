"""Compile as a ComfyUI user meets it: graphs for 32 new tokens of a tiny Qwen2 decode, and the first-prompt time
of the tiny compile workflow through a real server.

The graph count runs in process through `lazy_compile` (backend inductor, each `dynamic_shape_tracing` setting;
off is torch's automatic dynamic). The server figures come from tests/comfy/test_compile_server.py, which starts
the core at COMFYUI_ROOT with the pack and the tiny model, and queues examples/workflows/streamwise_compile.json
(32 new tokens, verbose) as that server's first prompt. Run:

    COMFYUI_ROOT=/path/to/ComfyUI python benchmarks/bench_compile_server.py [--backend inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from report import recorded  # this folder's: results/<name>-<date>.md

REPO = Path(__file__).resolve().parents[1]


def decode_graphs(backend: str, dynamic: bool, tokens: int = 32) -> tuple[int, float]:
    """Graphs (and seconds) that `tokens` greedy tokens of the tiny Qwen2 compile, from a fresh dynamo."""
    import torch

    import streamwise

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import tiny_qwen2

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tiny_qwen2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        streamwise.lazy_compile(model, "decoder-llm", backend=backend, dynamic_shape_tracing=dynamic)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(torch.tensor([[1, 2, 3, 4, 5, 6]]), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False)
    return streamwise.compile_stats(model).graphs, time.perf_counter() - start


def server_figures() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        test = ["tests/comfy/test_compile_server.py", "-k", "first_compiled_prompt"]
        subprocess.run([sys.executable, "-m", "pytest", "-q", *test], cwd=REPO, check=True,
                       env=dict(os.environ, STREAMWISE_BENCH_OUT=str(out)))
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    print(f"tiny Qwen2 (2 layers), 6-token prompt, 32 new tokens, backend {args.backend}, CPU")
    for dynamic in (False, True):
        graphs, seconds = decode_graphs(args.backend, dynamic)
        print(f"  dynamic_shape_tracing={dynamic!s:<5}  {graphs:3d} graphs, generate {seconds:6.2f} s")
    if not os.environ.get("COMFYUI_ROOT"):
        print("COMFYUI_ROOT is not set: no server figures")
        return
    figures = server_figures()
    print(f"server at {os.environ['COMFYUI_ROOT']}: first prompt {figures['first_prompt_s']:.2f} s "
          f"(load, arm, compile, 32 tokens), {figures['graphs_32_tokens']} graphs")


if __name__ == "__main__":
    with recorded("compile_server"):
        main()
