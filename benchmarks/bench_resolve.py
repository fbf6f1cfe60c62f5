"""Resolve at tree-walk speed: `resolve` + `apply` of `vibevoice` against a plain class-swapping walk.

The full-size transformers VibeVoice tree (default config, on the `meta` device, ~1,280 modules).
Timed in interleaved rounds, medians:
- `named_modules`: the walk alone, for scale;
- `seed walk`: the seed document's `convert_tree_for_streaming`, written anew with the same per-module steps:
  walk `named_modules()`, skip the root and already-converted modules (`getattr` of the flag and of the
  resident marker), find the compute for the class by its name, list the direct parameters of modules without
  one, swap `__class__` and count a census; no policy matching, no coverage, no undo records, no diagnostics (the
  seed's `issubclass` scan over its built-in kinds is left out: no class here needs it);
- `lean walk`: a stricter baseline than the seed's: `named_modules()`, one class-name set lookup per module, the
  swap (past `nn.Module.__setattr__`, as `apply` swaps: through it, a swap costs ~2 us more) and an undo list,
  nothing else;
- `census walk`: the lean walk, also counting each tensor's bytes once (by id): the least work of a walk whose
  result reports coverage, as a plan does (timed cold only);
- `floor walk`: the census walk over streamwise's own walk (`walk_modules`, one stack, no generator per level),
  the fastest this code walks: what `resolve` + `apply` cannot do with less, before a single rule is decided or a
  plan entry made (timed cold only);
- `resolve`: the plan alone (precedence, coverage census, diagnostics);
- `resolve + apply`: `streamwise.apply_policy`, the plan carried out (`streamwise.revert` resets the tree
  outside the timed part);
- `... cold`: what a load does, on a tree built anew each round (untimed) with a policy read anew (untimed), so
  nothing decided for the policy is cached: `resolve + apply cold`, `lean walk cold`, `census walk cold` and
  `floor walk cold` (the same walks on the fresh tree). Class facts that no policy changes (a forward's signature,
  class names) stay known across rounds, as they do in a running process. The warm figures resolve the same Policy
  object and tree every round.
The walks swap the same modules the plan converts, and are swapped back outside the timed part. Timed in this
thread's CPU time, so time the machine spends on other work does not count; the ratios are medians of per-round
ratios (each round runs every variant once). Goals: `resolve + apply cold` no slower than `lean walk cold`, and warm
no slower than the seed walk. Run:

    python benchmarks/bench_resolve.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import transformers
from report import recorded  # this folder's: results/<name>-<date>.md
from torch import nn

import streamwise
from streamwise.runtime.plan.selectors import walk_modules


def build() -> nn.Module:
    with torch.device("meta"):
        return transformers.VibeVoiceForConditionalGeneration(transformers.VibeVoiceConfig())


def seed_names(plan) -> tuple[dict[str, str], set[str]]:
    """The class names the seed would list by hand: stream kind per class, and the relocating classes."""
    stream = {m.class_name.rsplit(".", 1)[-1]: m.stream for m in plan.modules if m.stream}
    relocate = {m.class_name.rsplit(".", 1)[-1] for m in plan.modules if m.relocate}
    return stream, relocate


def seed_walk(model: nn.Module, stream: dict[str, str], relocate: set[str], classes: dict) -> list:
    """The seed's `convert_tree_for_streaming` step by step; returns the modules it swapped, with their classes.

    `stream` stands for the seed's registry of compute classes (by class name, restricted here to what the plan
    streams); `relocate` for its rule "a module with direct parameters and a forward becomes a streaming
    container", restricted to what the plan relocates.
    """
    skip = [model]
    census: dict[str, int] = {}
    swapped = []
    for _, module in model.named_modules():
        if module is model or any(module is s for s in skip):
            continue
        base = type(module)
        if getattr(module, "comfy_cast_weights", False) or getattr(module, "_quant_resident", False):
            continue  # already streaming, or a quantized resident
        name = base.__name__
        if name not in stream:
            direct = [n for n, _ in module.named_parameters(recurse=False)]
            # the seed's containers: direct parameters and a forward; here only those the plan relocates
            if name not in relocate or not (direct or module._buffers) or base.forward is nn.Module.forward:
                continue
        target = classes.get(base)
        if target is None:
            target = classes[base] = type(f"Seed{name}", (base,), {})
        module.__class__ = target
        swapped.append((None, module, base))
        census[name] = census.get(name, 0) + 1
    return swapped


def lean_walk(model: nn.Module, stream: dict[str, str], relocate: set[str], classes: dict,
              census: dict[int, int] | None = None, walk: Callable[[nn.Module], Iterable] | None = None) -> list:
    """Swap every listed class for its subclass; the undo list is what the walk returns. With a `census` (the
    census walk), also note each tensor's bytes there once, by id; with a `walk`, visit the tree by it instead of
    `named_modules()`."""
    undo = []
    for path, module in model.named_modules() if walk is None else walk(model):
        if census is not None and (module._parameters or module._buffers):
            for tensors in (module._parameters, module._buffers):
                for tensor in tensors.values():
                    if tensor is not None and id(tensor) not in census:
                        census[id(tensor)] = tensor.nbytes
        cls = type(module)
        name = cls.__name__
        if name in stream or name in relocate:
            target = classes.get(cls)
            if target is None:
                target = classes[cls] = type(f"Seed{name}", (cls,), {})
            undo.append((path, module, cls))
            object.__setattr__(module, "__class__", target)  # past nn.Module.__setattr__, as apply does
    return undo


def census_walk(model: nn.Module, stream: dict[str, str], relocate: set[str], classes: dict,
                census: dict[int, int] | None = None, walk: Callable[[nn.Module], Iterable] | None = None) -> list:
    """The lean walk counting each tensor's bytes once: the least a walk that reports coverage does."""
    return lean_walk(model, stream, relocate, classes, census={} if census is None else census, walk=walk)


def floor_walk(model: nn.Module, stream: dict[str, str], relocate: set[str], classes: dict,
               census: dict[int, int] | None = None) -> list:
    """The census walk over streamwise's own walk (one stack, no generator per level): the least `resolve` + `apply`
    could do, before a single rule is decided or a plan entry made."""
    return census_walk(model, stream, relocate, classes, census, walk=walk_modules)


def timed(run: Callable[[], object]) -> float:
    start = time.thread_time()
    run()
    return time.thread_time() - start


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
    paths = {module: path for path, module in model.named_modules()}
    for counting in (census_walk, floor_walk):
        census: dict[int, int] = {}
        for _, module, cls in counting(model, stream, relocate, classes, census):
            module.__class__ = cls
        assert sum(census.values()) == sum(plan.coverage.bytes.values()), \
            f"{counting.__name__} must count what the plan does"
    for baseline in (seed_walk, lean_walk, census_walk, floor_walk):
        undo = baseline(model, stream, relocate, classes)
        swapped = {paths[module] for _, module, _ in undo}
        assert swapped == converted, f"{baseline.__name__} must swap what the plan converts"
        for _, module, cls in undo:
            module.__class__ = cls
    undo = []

    def walk() -> float:
        return timed(lambda: sum(1 for _ in model.named_modules()))

    def swapping(baseline: Callable) -> Callable[[], float]:
        def run() -> float:
            elapsed = timed(lambda: undo.extend(baseline(model, stream, relocate, classes)))
            for _, module, cls in undo:
                module.__class__ = cls
            undo.clear()
            return elapsed

        return run

    def resolve_only() -> float:
        return timed(lambda: streamwise.resolve(policy, model))

    def resolve_apply() -> float:
        elapsed = timed(lambda: streamwise.apply_policy(model, policy))
        streamwise.revert(model)
        return elapsed

    def resolve_apply_cold() -> float:
        fresh, fresh_policy = build(), streamwise.load_policy("vibevoice")
        return timed(lambda: streamwise.apply_policy(fresh, fresh_policy))

    def cold(baseline: Callable) -> Callable[[], float]:
        def run() -> float:
            fresh = build()
            return timed(lambda: baseline(fresh, stream, relocate, classes))

        return run

    runs = {"named_modules": walk, "seed walk": swapping(seed_walk), "lean walk": swapping(lean_walk),
            "resolve": resolve_only, "resolve + apply": resolve_apply, "lean walk cold": cold(lean_walk),
            "census walk cold": cold(census_walk), "floor walk cold": cold(floor_walk),
            "resolve + apply cold": resolve_apply_cold}
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
        print(f"  {name:<20} {statistics.median(values) * 1e3:8.2f} ms")
    median = {name: statistics.median(values) for name, values in samples.items()}
    applying = median["resolve + apply"] - median["resolve"]
    print(f"apply within resolve + apply: {applying * 1e3:.2f} ms ({applying / median['resolve + apply']:.0%})")
    for ours, walk_name, goal in (("resolve + apply", "seed walk", " (goal <= 1.00x)"),
                                  ("resolve + apply", "lean walk", ""),
                                  ("resolve + apply cold", "lean walk cold", " (goal <= 1.00x)"),
                                  ("census walk cold", "lean walk cold", ""),
                                  ("floor walk cold", "lean walk cold", ""),
                                  ("resolve + apply cold", "census walk cold", "")):
        ratio = [mine / theirs for mine, theirs in zip(samples[ours], samples[walk_name], strict=True)]
        low, _, high = statistics.quantiles(ratio, n=4)
        print(f"{ours} / {walk_name}: {statistics.median(ratio):.2f}x (quartiles {low:.2f}x, {high:.2f}x){goal}")


if __name__ == "__main__":
    with recorded("resolve"):
        main()
