"""Device maps: `infer_device_map` against accelerate's `infer_auto_device_map` on meta 7B trees, same budgets.

transformers' default Llama and Qwen2 configs (7B-class, 32 layers, float32 on meta), two accelerators of 20 GiB
and 64 GiB of CPU, blocks kept whole on both sides (Streamwise's compile blocks from the `decoder-llm` plan,
accelerate's `no_split_module_classes` from the model's `_no_split_modules`). The plan is resolved once, outside
the timing (a row also times `infer_device_map` given the policy name, resolving inside). One call of each in turn
per round, in the thread's CPU time; the ratio is the median of the per-round ratios (goal: at most 1.0x). Run:

    python benchmarks/bench_dispatch.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import transformers
from accelerate.utils import infer_auto_device_map
from report import recorded  # this folder's: results/<name>-<date>.md

import streamwise
from streamwise.runtime.hosts.dispatch import infer_device_map

BUDGETS = {"cuda:0": "20GiB", "cuda:1": "20GiB", "cpu": "64GiB"}
ACCELERATE_BUDGETS = {0: "20GiB", 1: "20GiB", "cpu": "64GiB"}  # accelerate's spelling of the same


def timed(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Each of `fns` called once per round, in turn, after one warm-up round; thread CPU seconds."""
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.thread_time()
            fn()
            samples[name].append(time.thread_time() - start)
    return samples


def report(name: str, model: torch.nn.Module, rounds: int) -> None:
    plan = streamwise.resolve(streamwise.load_policy("decoder-llm"), model)
    samples = timed({
        "streamwise": lambda: infer_device_map(model, plan, BUDGETS),
        "accelerate": lambda: infer_auto_device_map(model, max_memory=ACCELERATE_BUDGETS,
                                                    no_split_module_classes=model._no_split_modules),
        "streamwise, resolving": lambda: infer_device_map(model, "decoder-llm", BUDGETS),
    }, rounds)
    print(f"  {name} ({sum(1 for _ in model.modules())} modules)")
    for label, runs in samples.items():
        ratio = statistics.median(ours / theirs for ours, theirs in zip(runs, samples["accelerate"], strict=True))
        print(f"    {label:<22} {statistics.median(runs) * 1e3:7.2f} ms   {ratio:5.2f}x accelerate's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "Device 0 is not available": this machine has none
    print(f"meta trees, budgets {BUDGETS}, {args.rounds} interleaved rounds, thread CPU time, medians")
    for name, cls, config in (("Llama-7B", transformers.LlamaForCausalLM, transformers.LlamaConfig()),
                              ("Qwen2-7B", transformers.Qwen2ForCausalLM, transformers.Qwen2Config())):
        with torch.device("meta"):
            model = cls(config)
        report(name, model, args.rounds)

if __name__ == "__main__":
    with recorded("dispatch"):
        main()
