"""CPU dequantization throughput: `runtime.quant.gguf_dequant.dequantize` against gguf's numpy reference.

Both expand the same random 4096x4096 Q8_0 and Q4_K tensors (float16 scale fields kept finite) to
float32. After a warm-up the two are timed in alternation, so that drift in a shared machine's
speed hits both alike, and each is reported as its median, in MB of float32 output per second.
The results are also checked to be bit-identical. The time to merely allocate and first touch a
fresh float32 output of that size is printed too, as a plain buffer and on huge pages: those page
faults are part of both sides' cost, and on few cores they bound the reachable speedup.
Goal: the torch kernels at least 5x faster than the reference. Run:

    python benchmarks/bench_dequant.py [--rows 4096] [--cols 4096] [--runs 15]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import gguf
import numpy as np
import torch

from streamwise.runtime.quant import huge_pages
from streamwise.runtime.quant.gguf_dequant import dequantize

QType = gguf.GGMLQuantizationType
# Byte offsets of the float16 scale fields inside one block.
SCALE_OFFSETS = {QType.Q8_0: (0,), QType.Q4_K: (0, 2)}
GOAL = 5.0


def random_blocks(qtype: QType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, -1)


def median_seconds(*fns, runs: int, warmup: int) -> list[float]:
    """The median time of each of `fns`, called in turn `runs` times after `warmup` rounds."""
    times = [[] for _ in fns]
    for index in range(warmup + runs):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            if index >= warmup:
                samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shape = (args.rows, args.cols)
    out_mb = args.rows * args.cols * 4 / 1e6
    print(f"{args.rows}x{args.cols} -> float32, torch threads: {torch.get_num_threads()}")
    cpu = torch.device("cpu")
    plain_s, huge_s = median_seconds(
        lambda: torch.empty(shape).fill_(0), lambda: huge_pages.empty(shape, torch.float32, cpu).fill_(0),
        runs=args.runs, warmup=args.warmup,
    )
    print(f"fresh output alone (empty + fill): {out_mb / plain_s:6.0f} MB/s, on huge pages {out_mb / huge_s:6.0f} MB/s")
    speedups = []
    for qtype in SCALE_OFFSETS:
        raw = random_blocks(qtype, args.rows, args.cols, rng)
        blocks = torch.from_numpy(raw)
        same = torch.equal(dequantize(blocks, qtype, shape), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
        ref_s, ours_s = median_seconds(
            functools.partial(gguf.quants.dequantize, raw, qtype), functools.partial(dequantize, blocks, qtype, shape),
            runs=args.runs, warmup=args.warmup,
        )
        speedups.append(ref_s / ours_s)
        print(
            f"{qtype.name:5s} reference {out_mb / ref_s:8.0f} MB/s  torch {out_mb / ours_s:8.0f} MB/s  "
            f"speedup {ref_s / ours_s:5.1f}x  bit-exact: {same}"
        )
    worst = min(speedups)
    print(f"worst speedup {worst:.1f}x (goal >= {GOAL:.0f}x): {'met' if worst >= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
