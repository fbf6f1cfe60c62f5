"""CPU dequantization speed: Streamwise's torch kernels against gguf's numpy reference and ComfyUI-GGUF.

Every type Streamwise dequantizes is expanded from the same 4096x4096 blocks to float32 by each
implementation that has it, twice: with finite float16 scales, and with fully random bytes (NaN,
Inf and subnormal scales). After a warm-up the implementations are timed in alternation, round
after round, so that drift in a shared machine's speed hits all alike, and each is reported as its
median. Streamwise's output is checked against the reference bit for bit (stored F16 NaNs by place).
The time to allocate and first touch a fresh float32 output is printed too: those page faults are
part of every side's cost. With more than one torch thread, Streamwise is also timed on one thread in the same
rounds (`1 thread`, and how many times faster the threads make it). Goals: never slower than the reference, at
least 3x ComfyUI-GGUF (F32, a view everywhere, has none), and never slower on all threads than on one.

ComfyUI-GGUF's `dequant.py` is imported from the path given (its column is skipped without one;
nothing is fetched). Run:

    python benchmarks/bench_dequant.py [--threads 1 | --threads 0] [--comfyui-dequant /tmp/comfyui-gguf/dequant.py]
        [--types Q4_K IQ4_XS]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import torch

from streamwise.runtime.quant import huge_pages
from streamwise.runtime.quant.gguf_dequant import DEQUANTIZERS, STORED_FLOATS, dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_gguf_dequant import random_bytes  # the tests' blocks: finite scales, or random bytes

QType = gguf.GGMLQuantizationType
REFERENCE_GOAL, COMFYUI_GOAL, THREADS_GOAL = 1.0, 3.0, 1.0
VIEWS = {QType.F32}  # bytes read as float32 on every side: microseconds of bookkeeping, no goal


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f}ms" if seconds >= 1e-3 else f"{seconds * 1e6:7.1f}us"


def load_comfyui(path: str | None):
    """ComfyUI-GGUF's dequant module, imported from `path`, or None."""
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("comfyui_gguf_dequant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_seconds(fns: dict, runs: int, warmup: int) -> dict[str, float]:
    """The median time of each of `fns`, called in turn `runs` times after `warmup` rounds."""
    times = {name: [] for name in fns}
    for index in range(warmup + runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def on_one_thread(fn):
    """`fn` run with torch on one thread, the thread count restored after."""

    def run():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(threads)

    return run


def bit_exact(ours: torch.Tensor, reference: np.ndarray, qtype: QType) -> bool:
    expected = torch.from_numpy(np.ascontiguousarray(reference))
    if qtype == QType.F16:  # torch's own float16 widening quiets signalling NaNs: NaNs compare by place
        nan = expected.isnan()
        if not torch.equal(ours.isnan(), nan):
            return False
        ours, expected = ours.masked_fill(nan, 0), expected.masked_fill(nan, 0)
    return torch.equal(ours.view(torch.int32), expected.view(torch.int32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--comfyui-dequant", metavar="PATH", help="ComfyUI-GGUF's dequant.py")
    parser.add_argument("--types", nargs="+", metavar="TYPE", help="a subset of the types, by GGML name")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads; 0: torch's default, every core (numpy's reference runs on one)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threaded = torch.get_num_threads() > 1
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the reference's NaN arithmetic on random bytes

    comfyui = load_comfyui(args.comfyui_dequant)
    shape = (args.rows, args.cols)
    print(f"{args.rows}x{args.cols} -> float32, torch threads: {torch.get_num_threads()}, median of {args.runs}")
    cpu = torch.device("cpu")
    alloc = median_seconds({
        "plain": lambda: torch.empty(shape).fill_(0),
        "huge": lambda: huge_pages.empty(shape, torch.float32, cpu).fill_(0),
    }, args.runs, args.warmup)
    print(f"fresh output alone (empty + fill): {alloc['plain'] * 1e3:.1f} ms, "
          f"on huge pages {alloc['huge'] * 1e3:.1f} ms")
    print(f"{'type':8s} {'scales':7s} {'streamwise':>10s} {'numpy':>9s} {'ratio':>6s}"
          + (f" {'comfyui':>9s} {'ratio':>6s}" if comfyui else "")
          + (f" {'1 thread':>9s} {'ratio':>6s}" if threaded else "") + "  bit-exact")

    types = [QType[name] for name in args.types] if args.types else [*STORED_FLOATS, *DEQUANTIZERS]
    worst = {peer: (float("inf"), "") for peer in ("numpy", "comfyui", "1 thread")}
    for qtype in types:
        for finite in (True, False):
            raw = random_bytes(qtype, shape, seed=0, finite=finite)
            blocks = torch.from_numpy(raw)
            fns = {
                "streamwise": functools.partial(dequantize, blocks, qtype, shape),
                "numpy": functools.partial(gguf.quants.dequantize, raw, qtype),
            }
            if comfyui is not None and qtype in comfyui.dequantize_functions:
                fns["comfyui"] = functools.partial(comfyui.dequantize, blocks, qtype, shape, dtype=torch.float32)
            if threaded:
                fns["1 thread"] = on_one_thread(fns["streamwise"])
            same = bit_exact(dequantize(blocks, qtype, shape), gguf.quants.dequantize(raw, qtype), qtype)
            seconds = median_seconds(fns, args.runs, args.warmup)
            ours = seconds["streamwise"]
            line = f"{qtype.name:8s} {'finite' if finite else 'random':7s}  {ms(ours)}"
            for peer in ("numpy", "comfyui", "1 thread"):
                if peer in seconds:
                    ratio = seconds[peer] / ours
                    if qtype not in VIEWS:
                        worst[peer] = min(worst[peer], (ratio, f"{qtype.name} {'finite' if finite else 'random'}"))
                    line += f" {ms(seconds[peer])} {ratio:5.1f}x"
                elif peer == "comfyui" and comfyui is not None:
                    line += f" {'-':>9s} {'-':>6s}"
            print(f"{line}  {same}", flush=True)
    for peer, goal in (("numpy", REFERENCE_GOAL), ("comfyui", COMFYUI_GOAL), ("1 thread", THREADS_GOAL)):
        ratio, where = worst[peer]
        if where:
            verdict = "met" if ratio >= goal else "NOT met"
            print(f"worst vs {peer}: {ratio:.1f}x ({where}; goal >= {goal:.0f}x): {verdict}")


if __name__ == "__main__":
    main()
