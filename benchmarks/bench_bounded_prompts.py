"""The bounded cases of ComfyUI nodes through a real server: a prompt past the model's context refused, a long
generation and a long prefill interrupted, and a cached prompt with a symlink to 3,000 folders in the models folder.

The figures come from tests/comfy/test_server.py (each test records what it measured), which starts the core at
COMFYUI_ROOT with the pack and the example models. Run:

    COMFYUI_ROOT=/path/to/ComfyUI python benchmarks/bench_bounded_prompts.py [--out benchmarks/results/NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = ("interrupt_ends_a_long_generation or interrupt_ends_a_long_prefill or prompt_past_the_context "
         "or cached_prompt_does_not_walk")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="STEM", help="write STEM.json and STEM.md")
    args = parser.parse_args()
    if not os.environ.get("COMFYUI_ROOT"):
        parser.error("set COMFYUI_ROOT to a ComfyUI checkout")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/comfy/test_server.py", "-k", TESTS], cwd=REPO,
                       check=True, env=dict(os.environ, STREAMWISE_BENCH_OUT=str(out)))
        figures = json.loads(out.read_text())
    core = subprocess.run(["git", "-C", os.environ["COMFYUI_ROOT"], "log", "-1", "--format=%h %cs"],
                          capture_output=True, text=True).stdout.strip() or os.environ["COMFYUI_ROOT"]
    lines = [f"# Bounded prompts through a real server ({datetime.date.today()}, core {core}, {os.cpu_count()} CPUs)",
             "", "| case | seconds |", "|---|---|", *(f"| {name} | {value:.3f} |" for name, value in figures.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(figures, indent=2) + "\n")
        Path(f"{args.out}.md").write_text(text)


if __name__ == "__main__":
    main()
