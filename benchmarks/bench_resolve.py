"""Resolve at tree-walk speed: `resolve` + `apply` of `vibevoice` against a plain class-swapping walk.

The full-size transformers VibeVoice tree (default config, on the `meta` device, ~1,280 modules).
Timed in interleaved rounds, medians:
- `named_modules`: the walk alone, for scale;
- `plain walk`: the seed document's way, written anew as the baseline: walk `named_modules()`, decide
  by class-name set lookups, swap `__class__` to a per-class subclass and record how to undo it (no
  policy matching, no coverage, no diagnostics); it swaps the same modules the plan converts, and
  swaps them back outside the timed part;
- `resolve`: the plan alone (precedence, coverage census, diagnostics);
- `resolve + apply`: the plan carried out (`streamwise.revert` resets the tree outside the timed part).
Goal: `resolve + apply` no slower than the plain walk. Run:

    python benchmarks/bench_resolve.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from torch import nn

import streamwise


def build() -> nn.Module:
    with torch.device("meta"):
        return transformers.VibeVoiceForConditionalGeneration(transformers.VibeVoiceConfig())


def seed_names(plan) -> tuple[dict[str, str], set[str]]:
    """The class names the seed would list by hand: stream kind per class, and the relocating classes."""
    stream = {m.class_name.rsplit(".", 1)[-1]: m.stream for m in plan.modules if m.stream}
    relocate = {m.class_name.rsplit(".", 1)[-1] for m in plan.modules if m.relocate}
    return stream, relocate


def plain_walk(model: nn.Module, stream: dict[str, str], relocate: set[str], classes: dict) -> list:
    """Swap every listed class for its subclass; the undo list is what the walk returns."""
    undo = []
    for path, module in model.named_modules():
        cls = type(module)
        name = cls.__name__
        if name in stream or name in relocate:
            target = classes.get(cls)
            if target is None:
                target = classes[cls] = type(f"Seed{name}", (cls,), {})
            undo.append((path, module, cls))
            module.__class__ = target
    return undo


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    policy = streamwise.load_policy("vibevoice")
    model = build()
    plan = streamwise.resolve(policy, model)
    stream, relocate = seed_names(plan)
    classes: dict[type, type] = {}

    converted = {m.path for m in plan.modules if m.stream or m.relocate}
    undo = plain_walk(model, stream, relocate, classes)
    assert {path for path, _, _ in undo} == converted, "the plain walk must swap the modules the plan converts"
    for _, module, cls in undo:
        module.__class__ = cls
    undo.clear()

    def walk() -> float:
        return timed(lambda: sum(1 for _ in model.named_modules()))

    def plain() -> float:
        elapsed = timed(lambda: undo.extend(plain_walk(model, stream, relocate, classes)))
        for _, module, cls in undo:
            module.__class__ = cls
        undo.clear()
        return elapsed

    def resolve_only() -> float:
        return timed(lambda: streamwise.resolve(policy, model))

    def resolve_apply() -> float:
        elapsed = timed(lambda: streamwise.apply(streamwise.resolve(policy, model), model))
        streamwise.revert(model)
        return elapsed

    runs = {"named_modules": walk, "plain walk": plain, "resolve": resolve_only, "resolve + apply": resolve_apply}
    for run in runs.values():  # warm the class caches
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        order = list(runs.items())
        for name, run in order[round_ % len(order):] + order[: round_ % len(order)]:  # rotate who runs first
            samples[name].append(run())

    print(f"VibeVoice (transformers, default config, meta): {len(list(model.modules()))} modules, "
          f"{len(converted)} converted; median of {args.rounds} rounds")
    for name, values in samples.items():
        print(f"  {name:<16} {statistics.median(values) * 1e3:8.2f} ms")
    median = {name: statistics.median(values) for name, values in samples.items()}
    applying = median["resolve + apply"] - median["resolve"]
    print(f"apply within resolve + apply: {applying * 1e3:.2f} ms ({applying / median['resolve + apply']:.0%})")
    print(f"resolve / plain walk: {median['resolve'] / median['plain walk']:.2f}x; "
          f"resolve + apply / plain walk: {median['resolve + apply'] / median['plain walk']:.2f}x (goal <= 1.00x)")


if __name__ == "__main__":
    main()
