"""CPU speed of INT8 residents against the float layer they replace.

One 4096x4096 Linear, batch 1 and 16 rows: float32 `F.linear`, an `int8` resident (W8A16 through
`torch._weight_int8pack_mm`) and a `convrot_int8` resident (plus the online rotation). Run:

    python benchmarks/bench_int8.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from report import recorded  # this folder's: results/<name>-<date>.md
from torch import nn

import streamwise
from streamwise.schemas import Policy


def policy(fmt: str) -> Policy:
    rule = {
        "id": "q", "select": {"class": "Linear"}, "format": fmt,
        **({"group_size": 256} if "convrot" in fmt else {}),
    }
    return Policy.model_validate({
        "schema_version": 1, "policy": {"name": "bench"},
        "stream": {"rule": [{"id": "l", "kind": "linear", "select": {"class": "Linear"}}]},
        "quant": {"rule": [rule]},
    })


def timed(layer: nn.Module, x: torch.Tensor, repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            layer(x)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            layer(x)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4096, 4096))
    variants = {"float32": base}
    for fmt in ("int8", "convrot_int8"):
        variant = copy.deepcopy(base)
        streamwise.apply(streamwise.resolve(policy(fmt), variant), variant)
        variants[fmt] = variant
    print(f"4096x4096 Linear on the CPU, {torch.get_num_threads()} threads, median of {args.repeats}")
    for rows in (1, 16):
        x = torch.randn(rows, 4096)
        reference = timed(base, x, args.repeats)
        for name, layer in variants.items():
            seconds = timed(layer, x, args.repeats)
            print(f"  rows {rows:>2}  {name:<13} {seconds * 1e3:8.2f} ms   x{reference / seconds:5.2f} vs float32")
    weight_bytes = {
        name: sum(t.numel() * t.element_size() for t in layer.parameters()) for name, layer in variants.items()
    }
    print("  weight bytes: " + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in weight_bytes.items()))


if __name__ == "__main__":
    with recorded("int8"):
        main()
