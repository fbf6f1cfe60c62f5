"""Cold compile time, regional (blocks only) against whole-model, and compiled against eager speed.

A 12-block MLP-transformer-style model (width 256) runs on the CPU with the inductor backend.
Each cold compile runs in a fresh process with inductor's caches disabled. Run:

    python benchmarks/bench_compile.py [--backend inductor] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time, torch, warnings
import streamwise
from streamwise.schemas import Policy

sys.path.insert(0, sys.argv[4])
from toy_blocks import Net

mode, backend, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
policy = Policy.model_validate(
    {"schema_version": 1, "policy": {"name": "bench"}, "compile": {"blocks": {"class": "Block"}}}
)
torch.manual_seed(0)
model, x = Net().eval(), torch.randn(8, 256)

def timed():
    with torch.inference_mode():
        for _ in range(5):
            model(x)
        samples = []
        for _ in range(iters):
            start = time.perf_counter(); model(x); samples.append(time.perf_counter() - start)
    return statistics.median(samples)

result = {"mode": mode}
if mode == "eager":
    result["forward_ms"] = timed() * 1e3
else:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        streamwise.lazy_compile(model, policy, backend=backend, compile_transformer_blocks_only=(mode == "blocks"))
    start = time.perf_counter()
    with torch.inference_mode():
        model(x)
    result["first_call_s"] = time.perf_counter() - start
    result["forward_ms"] = timed() * 1e3
    stats = streamwise.compile_stats(model)
    result.update(graphs=stats.graphs, graph_breaks=stats.graph_breaks, compile_s=stats.compile_seconds)
print(json.dumps(result))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    results = {}
    for mode in ("eager", "blocks", "whole"):
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run([sys.executable, "-c", CHILD, mode, args.backend, str(args.iters), here],
                             check=True, capture_output=True, text=True, env=env).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    eager = results["eager"]["forward_ms"]
    print(f"12 blocks (width 256), batch 8, backend {args.backend}, CPU, cold caches")
    print(f"  eager                      forward {eager:7.3f} ms")
    for mode in ("blocks", "whole"):
        r = results[mode]
        print(f"  {mode + ' compile':<26} first call {r['first_call_s']:6.2f} s (backend {r['compile_s']:6.2f} s, "
              f"{r['graphs']} graph(s), {r['graph_breaks']} breaks), forward {r['forward_ms']:7.3f} ms "
              f"(x{eager / r['forward_ms']:.2f} vs eager)")


if __name__ == "__main__":
    main()
