"""Cold compile by depth: graphs and first-call time of a decoder under `lazy_compile`, at 2, 8 and 24 layers.

The tiny Qwen2 of the tests (hidden 64, 4 heads) at each depth, unconverted and streamed (`offload` at budget 0:
every leaf fetches inside the compiled blocks), armed with `lazy_compile(model, "decoder-llm")`, then one greedy
`generate`: a 6-token prompt and 32 new tokens. Each run is a fresh process with inductor's caches off, so every
graph compiles cold; rounds interleave every depth and mode, and the ratios against 2 layers are medians of the
per-round ratios. Every run checks its tokens against the eager model's. Run:

    python benchmarks/bench_compile.py [--rounds 3] [--layers 2 8 24] [--backend inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from report import recorded  # this folder's: results/<name>-<date>.md

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, warnings
import torch
import streamwise

sys.path.insert(0, sys.argv[4])
from helpers import tiny_qwen2

layers, mode, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = tiny_qwen2(num_hidden_layers=layers)
prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])

def generate():
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    return tokens, time.perf_counter() - start

expected, eager_s = generate()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if mode == "streamed":
        streamwise.offload(model, "decoder-llm", device="cpu", budget=0)
    streamwise.lazy_compile(model, "decoder-llm", backend=backend)
tokens, first_s = generate()
_, then_s = generate()
stats = streamwise.compile_stats(model)
print(json.dumps({"graphs": stats.graphs, "breaks": stats.graph_breaks, "fallbacks": len(stats.fallbacks),
                  "compile_s": stats.compile_seconds, "first_s": first_s, "then_s": then_s, "eager_s": eager_s,
                  "equal": bool(torch.equal(tokens, expected))}))
"""


def run(layers: int, mode: str, backend: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    child = subprocess.run([sys.executable, "-c", CHILD, str(layers), mode, backend, str(REPO / "tests")],
                           capture_output=True, text=True, env=env, cwd=REPO)
    if child.returncode:
        raise SystemExit(f"{layers} layers, {mode}: the run failed\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def row(layers: int, mode: str, runs: list[dict], bases: list[dict]) -> str:
    def median(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    def ratio(key: str) -> float:
        return statistics.median(run[key] / first[key] for run, first in zip(runs, bases, strict=True))

    graphs = "/".join(map(str, sorted({run["graphs"] for run in runs})))
    tokens = "equal" if all(run["equal"] for run in runs) else "DIFFER"
    fallbacks = max(run["fallbacks"] for run in runs)
    return (f"{layers:>6} {mode:<12} {graphs:>6} {max(run['breaks'] for run in runs):>6} {median('compile_s'):>9.2f} "
            f"{median('first_s'):>12.2f} {median('then_s'):>7.2f} {median('eager_s'):>7.2f}  "
            f"{ratio('compile_s'):>8.2f}x {ratio('first_s'):>6.2f}x  {tokens}"
            + (f", {fallbacks} fallback(s)" if fallbacks else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    modes = ("unconverted", "streamed")
    results: dict[tuple[int, str], list[dict]] = {(n, mode): [] for n in args.layers for mode in modes}
    for _ in range(args.rounds):
        for layers in args.layers:
            for mode in modes:
                results[layers, mode].append(run(layers, mode, args.backend))
    base = args.layers[0]
    print(f"tiny Qwen2 (hidden 64), 6-token prompt + 32 new tokens, backend {args.backend}, CPU, cold caches, "
          f"{args.rounds} interleaved round(s); medians, ratios against {base} layers per round")
    print(f"  {'layers':>6} {'mode':<12} {'graphs':>6} {'breaks':>6} {'compile s':>9} {'first call s':>12} "
          f"{'then s':>7} {'eager s':>7}  {'compile x':>9} {'first x':>7}  tokens")
    for mode in modes:
        for layers in args.layers:
            print("  " + row(layers, mode, results[layers, mode], results[base, mode]))

if __name__ == "__main__":
    with recorded("compile"):
        main()
