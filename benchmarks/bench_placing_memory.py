"""Host memory while `offload` packs a streamed tree's host tier (`engine.stream.arena`): the peak growth of the
process's anonymous memory during placing, beside the host tier's bytes and a piece's.

A float32 Qwen2-style decoder built in memory is placed at budget 0 through the streaming engine's ring, on the CPU
against the recording fake device (`tests/recording_device.py`: the same packing as on CUDA, pageable), each run in a
fresh process. `--package DIR` places with the Streamwise checkout linked as DIR/streamwise instead (the figures
before a change, from a `git worktree` of the commit before it; the result file is named by its commit). Goal: the
growth within one piece (`arena.PIECE`) and 10% of the tier.

    python benchmarks/bench_placing_memory.py [--layers 12] [--hidden 1024] [--runs 3] [--package DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from report import recorded  # this folder's

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
package, layers, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if package:
    sys.path.insert(0, package)
import torch
from bench_memory_tiers import Sampler
from recording_device import RecordingOps
from helpers import tiny_qwen2
import streamwise
from streamwise.runtime.engine.stream import arena
from streamwise.runtime.hosts import standalone

standalone.device_ops = lambda device: RecordingOps()
torch.manual_seed(0)
model = tiny_qwen2(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, vocab_size=2048,
                   num_attention_heads=16, num_key_value_heads=4)
time.sleep(0.2)
sampler = Sampler()
before, _ = sampler.peak["RssAnon"], sampler.start()
report = streamwise.offload(model, "decoder-llm", device="cpu", budget=0)
grew = sampler.stop()["RssAnon"] - before
print(json.dumps({"streamwise": streamwise.__file__, "host_tier": report.streamed_bytes - report.file_bytes,
                  "grew": grew, "piece": getattr(arena, "PIECE", None)}))
"""


def run(package: str, layers: int, hidden: int) -> dict:
    """One placing in a fresh process (its allocator's state its own)."""
    path = f"{REPO / 'benchmarks'}:{REPO / 'tests'}"
    done = subprocess.run([sys.executable, "-c", CHILD, package, str(layers), str(hidden)], capture_output=True,
                          text=True, cwd="/tmp", env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--package", default="", help="a folder holding a `streamwise` checkout to place with")
    args = parser.parse_args()
    label = ""
    if args.package:  # the figures before a change: named by the commit they were taken at
        label = "-" + subprocess.run(["git", "-C", str(Path(args.package).resolve() / "streamwise"), "rev-parse",
                                      "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    with recorded("placing_memory" + label):
        runs = [run(args.package, args.layers, args.hidden) for _ in range(args.runs)]
        tier, piece = runs[0]["host_tier"], runs[0]["piece"]
        grew = statistics.median(r["grew"] for r in runs)
        print(f"Streamwise from {runs[0]['streamwise']}; {args.layers} layers, hidden {args.hidden}, float32, "
              f"budget 0, recording fake device")
        print(f"host tier {tier / 2**20:.0f} MiB; piece {piece / 2**20:.0f} MiB" if piece else
              f"host tier {tier / 2**20:.0f} MiB; no pieces (one region)")
        print(f"anonymous memory grown while placing, median of {args.runs} [min-max]: {grew / 2**20:.0f} MiB "
              f"[{min(r['grew'] for r in runs) / 2**20:.0f}-{max(r['grew'] for r in runs) / 2**20:.0f}], "
              f"{grew / tier:.2f}x the host tier")
        if piece:
            print(f"goal (within a piece and 10% of the tier): {'met' if grew <= piece + tier / 10 else 'NOT met'}")


if __name__ == "__main__":
    main()
