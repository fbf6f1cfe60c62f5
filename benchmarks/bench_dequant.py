"""CPU dequantization speed: Streamwise's torch kernels against gguf's numpy reference and ComfyUI-GGUF.

Every type Streamwise dequantizes is expanded from the same 4096x4096 blocks to float32 by each
implementation that has it, twice: with finite float16 scales, and with fully random bytes (NaN,
Inf and subnormal scales). After a warm-up the implementations are timed in alternation, round
after round, so that drift in a shared machine's speed hits all alike, and each is reported as its
median. Streamwise's output is checked against the reference bit for bit (stored F16 NaNs by place). `streamwise` is
what `dequantize` runs: numba's fused kernels for the types that have one where numba is installed (the
`cpu-kernels` extra), else the torch kernels; `torch kernels` times those alone beside the fused ones.

Every side writes into the same kind of fresh output buffer: each configuration runs in its own process under one
allocator for all, `thp` (torch's `THP_MEM_ALLOC_ENABLE=1`: every large allocation on huge pages) or `plain` (none
on huge pages, Streamwise's own advice off too). The floor beside them is what writing a fresh float32 output of
that size alone costs under the same allocator: no implementation can be faster, so `ceiling` = the peer's time
over the floor is the most any could beat the peer by. Configurations: one thread and every thread count up to the
machine's. Goals: never slower than the reference, at least 3x ComfyUI-GGUF where the ceiling allows it (F32, a
view everywhere, has none), and never slower on more threads than on one.

`--device cuda` times the same kernels on a GPU instead (where ComfyUI-GGUF's users dequantize): blocks and outputs
on the device, each call synchronized, the reference run on the CPU only to check bits; allocators and thread
counts do not apply there. The weights are `GPU_SHAPES` (4096x4096, a 7-8B MLP and a Flux MLP both ways) unless
`--shapes` says; beside each, a device-to-device copy of as many bytes as the expansion reads and writes, so each
expansion's rate reads as a share of the memory's. For the types with a Triton kernel (`gguf_triton`) `streamwise`
is that kernel, beside the torch kernels alone, each also writing bfloat16 (a GPU's compute dtype, where Triton
writes it directly). `--quick`: Q8_0, Q4_K and Q6_K at one shape. `--dry-run`: that path on the CPU, the Triton
kernels in their interpreter at a small shape (a GPU run cannot fail on what the first minutes would find).

ComfyUI-GGUF's `dequant.py` is one of the benchmark's inputs (`peers/comfyui_gguf_dequant.py`, Apache-2.0, at the
commit `PEER_COMMIT` names: a GPU machine without network still has it), timed on the same blocks, writing float32
and, on a GPU, bfloat16 too (its `dequant_dtype="target"`); another copy of it is imported from the path given, its
commit read from its checkout or given. Run:

    python benchmarks/bench_dequant.py [--comfyui-dequant /tmp/ComfyUI-GGUF/dequant.py]
        [--out benchmarks/results/dequant-DATE] [--allocators thp plain] [--threads 1 2] [--types Q4_K IQ4_XS]
        [--device cuda [--quick] [--shapes 4096x4096 ...]] [--dry-run] [--count-ops]

`--count-ops` prints the ops each side runs per call instead, counted on `meta` tensors. With `--out`, each type's
row is appended to STEM.jsonl as it is measured (a run cut off keeps what it measured), the report written at the end.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

QTYPE_GOALS = {"numpy": 1.0, "comfyui": 3.0, "1 thread": 1.0}
GPU_GOALS = {"comfyui": 2.0, "comfyui bf16": 2.0}
COPY_RATE_GOAL = 0.5
"""On a GPU: at least 2x ComfyUI-GGUF on the types it has, and each expansion at half a device copy's rate or more."""
ALLOCATORS = {"thp": {"THP_MEM_ALLOC_ENABLE": "1"}, "plain": {}}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f}ms" if seconds >= 1e-3 else f"{seconds * 1e6:7.1f}us"


PEER = Path(__file__).with_name("peers") / "comfyui_gguf_dequant.py"
PEER_COMMIT = "795e45156ece99afbc3efef911e63fcb46e6a20d 2025-12-18"
"""city96/ComfyUI-GGUF's commit whose `dequant.py` is `PEER`, byte for byte (its latest change: int64 indices)."""


def load_comfyui(path: str | None):
    """ComfyUI-GGUF's dequant module, imported from `path`, or None."""
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("comfyui_gguf_dequant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_version(path: str | None, given: str | None) -> str | None:
    """The commit of the checkout holding `path`, or `given`; `PEER_COMMIT` for `PEER`."""
    if given or path is None:
        return given
    if Path(path).resolve() == PEER.resolve():
        return PEER_COMMIT
    found = subprocess.run(["git", "-C", str(Path(path).parent), "log", "-1", "--format=%H %cs"],
                           capture_output=True, text=True)
    return found.stdout.strip() or None


def median_seconds(fns: dict, runs: int, warmup: int, synchronize=lambda: None) -> dict[str, float]:
    """The median time of each of `fns`, called in turn `runs` times after `warmup` rounds (each call ended by
    `synchronize`: the device's queue drained)."""
    times = {name: [] for name in fns}
    for index in range(warmup + runs):
        for name, fn in fns.items():
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def measure(args) -> None:
    """One configuration (this process's allocator and thread count): a JSON line per type and kind of scales."""
    import gguf
    import numpy as np
    import torch

    from streamwise.runtime.quant import gguf_dequant, gguf_triton, huge_pages, numba_kernels
    from streamwise.runtime.quant.gguf_dequant import DEQUANTIZERS, STORED_FLOATS, dequantize

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_blocks import random_bytes  # the tests' blocks: finite scales, or random bytes

    qtype_of = gguf.GGMLQuantizationType
    if args.allocator == "plain":  # no side on huge pages: Streamwise's own advice off as well
        huge_pages._advise_huge = lambda: None
    threads, device = args.threads[0], torch.device(args.device)
    torch.set_num_threads(threads)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the reference's NaN arithmetic on random bytes

    def on_one_thread(fn):
        def run():
            torch.set_num_threads(1)
            try:
                return fn()
            finally:
                torch.set_num_threads(threads)

        return run

    def swapped(fn, owner, name: str, value):
        """`fn` run with `owner.name` set to `value`, restored after."""
        def run():
            before = getattr(owner, name)
            setattr(owner, name, value)
            try:
                return fn()
            finally:
                setattr(owner, name, before)

        return run

    def torch_kernels(fn):  # the fused CPU kernels out of the way: the torch kernels' time beside them
        return swapped(fn, numba_kernels, "fused_dequant", lambda: None)

    def without_triton(fn):  # the Triton kernels out of the way (CUDA): the torch kernels' time beside them
        return swapped(fn, gguf_triton, "types", frozenset)

    def reference_design(fn):  # the torch kernels in the reference design's steps, as off the CPU
        return swapped(torch_kernels(fn), gguf_dequant, "torch_fields", lambda device: gguf_dequant.FIELDS)

    def bit_exact(ours, reference, qtype) -> bool:
        expected = torch.from_numpy(np.ascontiguousarray(reference))
        # torch's own float16 widening quiets signalling NaNs, and a GPU's arithmetic returns one canonical NaN (as
        # the Triton kernels do in a dry run's interpreter): there NaNs compare by place
        if qtype == qtype_of.F16 or device.type != "cpu" or args.dry_run:
            nan = expected.isnan()
            if not torch.equal(ours.isnan(), nan):
                return False
            ours, expected = ours.masked_fill(nan, 0), expected.masked_fill(nan, 0)
        return torch.equal(ours.view(torch.int32), expected.view(torch.int32))

    if args.dry_run:  # the GPU's choice on the CPU: the Triton kernels, run by their interpreter
        gguf_dequant._fused_gpu = lambda qtype, blocks: qtype in gguf_triton.types()
    comfyui = load_comfyui(args.comfyui_dequant)
    types = [qtype_of[name] for name in args.types] if args.types else [*STORED_FLOATS, *DEQUANTIZERS]
    for shape, qtype, finite in itertools.product(shapes(args), types, (True, False)):
        raw = random_bytes(qtype, shape, seed=0, finite=finite)
        blocks = torch.from_numpy(raw).to(device)
        moved = raw.nbytes + 4 * math.prod(shape)  # the blocks read, float32 written
        source, target = (torch.empty(moved // 2, dtype=torch.uint8, device=device) for _ in range(2))
        fns = {  # the floor in the same rounds: the machine's state moves it
            "floor": lambda shape=shape: torch.empty(shape, device=device).fill_(0),
            "streamwise": functools.partial(dequantize, blocks, qtype, shape),
        }
        if device.type != "cpu" or args.dry_run:  # as many bytes read and written: the memory's rate, to compare
            fns["copy"] = functools.partial(target.copy_, source)
        if device.type == "cpu":
            fns["numpy"] = functools.partial(gguf.quants.dequantize, raw, qtype)
        if comfyui is not None and qtype in comfyui.dequantize_functions:
            fns["comfyui"] = functools.partial(comfyui.dequantize, blocks, qtype, shape, dtype=torch.float32)
            if device.type != "cpu" or args.dry_run:
                fns["comfyui bf16"] = functools.partial(comfyui.dequantize, blocks, qtype, shape, dtype=torch.bfloat16)
        if gguf_dequant._fused_cpu(qtype, blocks) is not None:
            fns["torch kernels"] = torch_kernels(fns["streamwise"])
        if gguf_dequant._fused_gpu(qtype, blocks):  # Triton's: bf16 written directly, as a GPU computes
            fns["torch kernels"] = without_triton(fns["streamwise"])
            fns["streamwise bf16"] = functools.partial(dequantize, blocks, qtype, shape, torch.bfloat16)
            fns["torch kernels bf16"] = without_triton(fns["streamwise bf16"])
        if device.type == "cpu" and qtype in DEQUANTIZERS:
            fns["reference design"] = reference_design(fns["streamwise"])
        if threads > 1 and device.type == "cpu":
            fns["1 thread"] = on_one_thread(fns["streamwise"])
        same = bit_exact(dequantize(blocks, qtype, shape).cpu(), gguf.quants.dequantize(raw, qtype), qtype)
        seconds = median_seconds(fns, args.runs, args.warmup, synchronize)
        print(json.dumps({"device": device.type, "allocator": args.allocator, "threads": threads,
                          "type": qtype.name, "shape": "x".join(map(str, shape)),
                          "scales": "finite" if finite else "random", "bit_exact": same,
                          "view": qtype == qtype_of.F32, **seconds}), flush=True)


GPU_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (12288, 3072), (3072, 12288))
"""A GPU run's weights: 4096x4096, a 7-8B model's MLP both ways, a Flux MLP both ways."""
QUICK_TYPES = ("Q8_0", "Q4_K", "Q6_K")


def shapes(args) -> list[tuple[int, int]]:
    """The weights' shapes: `--shapes`, else a GPU run's (`GPU_SHAPES`; `--quick`: the first), else `--rows` x
    `--cols`; a dry run's a small one."""
    if args.dry_run:
        return [(64, 512)]
    if args.shapes:
        return [tuple(int(side) for side in shape.split("x")) for shape in args.shapes]
    if args.device != "cpu":
        return list(GPU_SHAPES[:1] if args.quick else GPU_SHAPES)
    return [(args.rows, args.cols)]


def count_ops(args) -> str:
    """The ops each side runs per call, counted on `meta` tensors (no data, no time): on a GPU each is a kernel
    launch, which is what a dequant of this size costs there. Views are free and not counted."""
    import collections

    import gguf
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from streamwise.runtime.quant.gguf_dequant import DEQUANTIZERS, dequantize

    free = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
            "transpose", "as_strided", "split", "split_with_sizes", "unbind", "alias", "detach", "empty", "narrow",
            "empty_like", "empty_strided", "lift_fresh"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count[func.overloadpacket.__name__ not in free] += 1
            return func(*args, **(kwargs or {}))

    def ops(fn) -> int:
        fn()  # lookup tables built once per device, as in use
        with Ops() as counted:
            fn()
        return counted.count[True]

    comfyui = load_comfyui(args.comfyui_dequant)
    shape = (args.rows, args.cols)
    lines = ["| type | streamwise | comfyui |", "|---|---|---|"]
    for qtype in [gguf.GGMLQuantizationType[name] for name in args.types] if args.types else DEQUANTIZERS:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = torch.zeros(math.prod(shape) // block_size * type_size, dtype=torch.uint8, device="meta")
        theirs = "-"
        if comfyui is not None and qtype in comfyui.dequantize_functions:
            theirs = ops(functools.partial(comfyui.dequantize, blocks, qtype, shape, dtype=torch.float32))
        lines.append(f"| {qtype.name} | {ops(functools.partial(dequantize, blocks, qtype, shape))} | {theirs} |")
    return "\n".join(lines) + "\n"


def report(rows: list[dict], peer: str | None, header: str) -> str:
    """The figures as Markdown: a table per configuration, then each goal's worst case."""
    lines = [header, ""]
    def configuration(row: dict) -> tuple:
        return row.get("device", "cpu"), row["allocator"], row["threads"]

    for device, allocator, threads in dict.fromkeys(map(configuration, rows)):
        config = [row for row in rows if configuration(row) == (device, allocator, threads)]
        title = f"allocator `{allocator}`, {threads} thread(s)" if device == "cpu" else f"device `{device}`"
        lines += [f"## {title}", "",
                  "| type | scales | output alone | streamwise | torch kernels | x | numpy | x | comfyui | x | ceiling "
                  "| 1 thread | x | bit-exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in config:
            cells = [f"{row['type']} {row.get('shape', '')}".strip(), row["scales"], ms(row["floor"]),
                     ms(row["streamwise"])]
            for peer_name in ("torch kernels", "numpy", "comfyui", "1 thread"):
                if peer_name in row:
                    cells += [ms(row[peer_name]), f"{row[peer_name] / row['streamwise']:.1f}x"]
                else:
                    cells += ["-", "-"]
                if peer_name == "comfyui":
                    cells.append(f"{row['comfyui'] / row['floor']:.1f}x" if "comfyui" in row else "-")
            lines.append("| " + " | ".join([*cells, str(row["bit_exact"])]) + " |")
        lines.append("")
        halves = [row for row in config if "streamwise bf16" in row]
        if halves:  # the Triton kernels writing a GPU's compute dtype, against the torch kernels' float32 and cast
            lines += ["| type | scales | streamwise bf16 | torch kernels bf16 | x | comfyui bf16 | x "
                      "| float32 at the copy's rate |", "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {row['type']} {row.get('shape', '')} | {row['scales']} | {ms(row['streamwise bf16'])} | "
                      f"{ms(row['torch kernels bf16'])} | {row['torch kernels bf16'] / row['streamwise bf16']:.1f}x | "
                      + (f"{ms(row['comfyui bf16'])} | {row['comfyui bf16'] / row['streamwise bf16']:.1f}x | "
                         if "comfyui bf16" in row else "- | - | ")
                      + f"{row['copy'] / row['streamwise']:.0%} |" for row in halves]
            lines.append("")
            slowest = min(halves, key=lambda row: row["copy"] / row["streamwise"])
            rate = slowest["copy"] / slowest["streamwise"]
            lines.append(f"- slowest float32 expansion at the copy's rate: {rate:.0%} ({slowest['type']} "
                         f"{slowest.get('shape', '')}; goal >= {COPY_RATE_GOAL:.0%}): "
                         + ("met" if rate >= COPY_RATE_GOAL else "NOT met"))
        for peer_name, goal in (GPU_GOALS if device != "cpu" else QTYPE_GOALS).items():
            timed = [row for row in config if peer_name in row and not row["view"]]
            if not timed:
                continue
            ours = "streamwise bf16" if peer_name.endswith("bf16") else "streamwise"
            worst = min(timed, key=lambda row, ours=ours: row[peer_name] / row[ours])
            ratio = worst[peer_name] / worst[ours]
            verdict = "met" if ratio >= goal else "NOT met"
            if peer_name == "comfyui" and device == "cpu":
                reachable = [row for row in timed if row["comfyui"] / row["floor"] >= goal]
                short = [f"{row['type']} {row['scales']}" for row in reachable
                         if row["comfyui"] / row["streamwise"] < goal]
                verdict += (f"; {len(timed) - len(reachable)} of {len(timed)} cases have a ceiling below "
                            f"{goal:.0f}x (the peer within {goal:.0f}x of writing the output alone); of the rest, "
                            f"{len(short)} short of it" + (f": {', '.join(short)}" if short else ""))
            lines.append(f"- worst vs {peer_name}: {ratio:.1f}x ({worst['type']} {worst['scales']}; goal >= "
                         f"{goal:.0f}x): {verdict}")
        designs = sorted((row["reference design"] / row.get("torch kernels", row["streamwise"]), row["type"])
                         for row in config if "reference design" in row)
        if designs:  # what the CPU's design of the torch kernels buys over the reference's, here
            lines.append(f"- the torch kernels' CPU design against the reference design on this CPU: "
                         f"{designs[0][0]:.2f}x ({designs[0][1]}) to {designs[-1][0]:.2f}x ({designs[-1][1]}), "
                         f"median {statistics.median(ratio for ratio, _ in designs):.2f}x")
        lines.append("")
    inexact = [f"{row.get('device', 'cpu')} {row['type']} {row['scales']}" for row in rows if not row["bit_exact"]]
    lines.append(f"ComfyUI-GGUF: {peer or 'not run'}. Streamwise's output against gguf's numpy reference, float32 "
                 f"bits (NaNs by place for F16 and on a GPU): {len(rows) - len(inexact)} of {len(rows)} bit-exact"
                 + (f"; not: {', '.join(inexact)}" if inexact else "") + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--comfyui-dequant", metavar="PATH", default=str(PEER),
                        help="ComfyUI-GGUF's dequant.py (default: the copy among the inputs)")
    parser.add_argument("--comfyui-version", help="its commit, where PATH is not in its git checkout")
    parser.add_argument("--types", nargs="+", metavar="TYPE", help="a subset of the types, by GGML name")
    parser.add_argument("--allocators", nargs="+", choices=ALLOCATORS, default=list(ALLOCATORS))
    parser.add_argument("--threads", nargs="+", type=int,
                        default=sorted({1, os.cpu_count() or 1}), help="torch thread counts (numpy runs on one)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the kernels timed on a GPU")
    parser.add_argument("--count-ops", action="store_true", help="the ops per call of each side instead of times")
    parser.add_argument("--shapes", nargs="+", metavar="ROWSxCOLS", help="weights' shapes (a GPU run: GPU_SHAPES)")
    parser.add_argument("--quick", action="store_true", help=f"types {', '.join(QUICK_TYPES)}, one shape, 3 runs")
    parser.add_argument("--dry-run", action="store_true",
                        help="the GPU run's path on the CPU: the Triton kernels in their interpreter, small weights")
    parser.add_argument("--out", metavar="STEM", help="write STEM.jsonl and STEM.md")
    parser.add_argument("--allocator", help=argparse.SUPPRESS)  # set in the process measuring one configuration
    args = parser.parse_args()
    if args.quick or args.dry_run:
        args.types, args.runs = args.types or list(QUICK_TYPES), min(args.runs, 3)
    if args.dry_run:
        args.device, args.allocators, args.threads, args.warmup = "cpu", ["plain"], [1], 0
    if args.allocator:
        return measure(args)
    forwarded = sys.argv[1:]
    if args.count_ops:
        peer = peer_version(args.comfyui_dequant, args.comfyui_version)
        text = (f"# Dequantization ops per call, {args.rows}x{args.cols} -> float32, off the CPU (on `meta`)\n\n"
                f"{datetime.date.today()}, `python benchmarks/bench_dequant.py {' '.join(forwarded)}`; "
                f"ComfyUI-GGUF {peer or '-'}\n\n{count_ops(args)}")
        print(text)
        if args.out:
            Path(f"{args.out}.md").write_text(text)
        return None
    rows = []
    on_cpu = args.device == "cpu"
    appended = open(f"{args.out}.jsonl", "w") if args.out else None  # a row each, as it comes
    for allocator in args.allocators if on_cpu else ["plain"]:
        for threads in args.threads if on_cpu else [1]:
            command = [sys.executable, __file__, *forwarded, "--allocator", allocator, "--threads", str(threads)]
            env = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
            env.update(ALLOCATORS[allocator], **({"TRITON_INTERPRET": "1"} if args.dry_run else {}))
            with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as child:
                for line in child.stdout:  # each type's row kept as it comes: a run cut off leaves its data
                    if line.startswith("{"):
                        rows.append(json.loads(line))
                        if appended is not None:
                            appended.write(line)
                            appended.flush()
            if child.returncode:
                raise subprocess.CalledProcessError(child.returncode, command)
            print(f"{allocator}, {threads} thread(s): {len(rows)} rows so far", file=sys.stderr, flush=True)
    peer = peer_version(args.comfyui_dequant, args.comfyui_version)
    import torch

    machine = f"{os.cpu_count()} CPUs" if on_cpu else torch.cuda.get_device_name(args.device)
    sizes = ", ".join("x".join(map(str, shape)) for shape in shapes(args))
    header = (f"# Dequantization, {sizes} -> float32, median of {args.runs} interleaved runs\n\n"
              f"{datetime.date.today()}, {machine}, torch {torch.__version__}, "
              f"`python benchmarks/bench_dequant.py {' '.join(forwarded)}`")
    text = report(rows, peer, header)
    print(text)
    if args.out:
        appended.close()
        Path(f"{args.out}.md").write_text(text)


if __name__ == "__main__":
    main()
