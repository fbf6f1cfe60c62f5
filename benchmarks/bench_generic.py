"""The generic kind's cost: every leaf of a decoder on `generic` against the specific kinds, both paths.

A 24-layer Qwen2-style transformers model (hidden 256), batch 1, one token per forward, on the CPU: many small
leaves, so any per-leaf cost shows. Five copies with equal weights run interleaved:
- `unconverted`: the transformers model as it is;
- `specific resident`: `decoder-llm` (linear, embedding, llama_rms_norm), `offload(budget=None)`: the fast path;
- `generic resident`: the same rules with every kind `generic`, `offload(budget=None)`: the fast path;
- `specific fetching`: `decoder-llm`, `offload(budget=0)`: every leaf fetches its weights per forward;
- `generic fetching`: every kind `generic`, `offload(budget=0)`: direct parameters fetched and shadowed in the
  instance dictionary while the class's own forward runs.
Before timing, every copy must give logits identical to the unconverted one, each converted copy must hold the
kinds it was meant to (counted with `protocol.kind_of`), and one forward must fetch once per leaf on the fetching
copies and never on the resident ones.
Each round runs `--iters` forwards of every copy, one of each in turn (the order rotates each round), and keeps
the median forward of each copy; the figures are medians over the rounds, and "paired" is the median of the
per-round ratios. Both fast paths run the same code (the class's own forward behind one flag check), so their
difference shows how much of the spread is the machine's noise.
Goal: the fast path of either kind at most 3% over unconverted; the generic fetching path's cost beside the
specific one is reported. Run:

    python benchmarks/bench_generic.py [--rounds 15] [--iters 40]
"""

from __future__ import annotations

import copy
import statistics
from collections import Counter

import torch
from bench_fast_path import build, timing_arguments  # the same decoder, timed the same way
from report import recorded  # this folder's: results/<name>-<date>.md
from torch import nn

import streamwise
from streamwise.runtime.engine import protocol

LAYERS = 24


def generic_policy():
    """`decoder-llm` with the kind of every stream rule set to `generic` (same selectors, same relocations)."""
    policy = streamwise.load_policy("decoder-llm")
    rules = tuple(rule.model_copy(update={"kind": "generic"}) for rule in policy.stream.rule)
    return policy.model_copy(update={
        "policy": policy.policy.model_copy(update={"name": "decoder-llm-generic"}),
        "stream": policy.stream.model_copy(update={"rule": rules}),
    })


def kinds(model: nn.Module) -> Counter:
    return Counter(kind for module in model.modules() if (kind := protocol.kind_of(module)) is not None)


def fetch_count(model: nn.Module, token: torch.Tensor) -> int:
    """How many times one forward asks the tree's fetcher for weights (instance wrappers, removed after)."""
    leaves = [module for module in model.modules() if protocol.kind_of(module) is not None]
    if not leaves:
        return 0
    fetcher = protocol.tree_of(leaves[0]).fetcher
    calls = 0
    originals = {name: getattr(fetcher, name) for name in ("fetch", "fetch_raw")}

    def counting(original):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(fetcher, name, counting(original))
    try:
        model(token)
    finally:
        for name in originals:
            delattr(fetcher, name)
    return calls


def main() -> None:
    args = timing_arguments(__doc__)

    base = copy.deepcopy(build())  # every variant is a deep copy, so all have the same memory layout
    specific, generic = streamwise.load_policy("decoder-llm"), generic_policy()
    variants = {  # name: (policy, budget, fetching)
        "specific resident": (specific, None, False),
        "generic resident": (generic, None, False),
        "specific fetching": (specific, 0, True),
        "generic fetching": (generic, 0, True),
    }
    models: dict[str, nn.Module] = {"unconverted": base}
    expected_specific = Counter({"linear": 0, "embedding": 0, "llama_rms_norm": 0})
    for module in base.modules():
        kind = {"Linear": "linear", "Embedding": "embedding", "Qwen2RMSNorm": "llama_rms_norm"}.get(
            type(module).__name__)
        if kind is not None:
            expected_specific[kind] += 1
    leaves = sum(expected_specific.values())  # 24 x (7 linears + 2 norms), the final norm, embedding and lm_head
    for name, (policy, budget, fetching) in variants.items():
        model = copy.deepcopy(base)
        report = streamwise.offload(model, policy, device="cpu", budget=budget)
        expected = expected_specific if policy is specific else Counter(generic=leaves)
        assert kinds(model) == expected, (name, kinds(model), expected)
        assert (report.streamed_modules, report.resident_modules) == ((leaves, 0) if fetching else (0, leaves)), \
            (name, report)
        models[name] = model

    token = torch.tensor([[7]])
    with torch.no_grad():
        reference = base(token).logits
        for name, model in models.items():
            assert torch.equal(model(token).logits, reference), name
            expected_fetches = leaves if name.endswith("fetching") else 0
            assert fetch_count(model, token) == expected_fetches, name
            for _ in range(10):
                model(token)
        samples: dict[str, list[float]] = {name: [] for name in models}
        for round_ in range(args.rounds):
            order = list(models.items())
            shift = round_ % len(order)
            order = order[shift:] + order[:shift]  # rotate who runs first
            forwards: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(args.iters):  # one forward of each in turn: a load that comes and goes hits all alike
                for name, model in order:
                    start = args.clock()
                    model(token)
                    forwards[name].append(args.clock() - start)
            for name, values in forwards.items():
                samples[name].append(statistics.median(values))  # a preempted forward does not move it

    medians = {name: statistics.median(values) for name, values in samples.items()}

    def ratio(a: str, b: str) -> tuple[float, float]:
        """Ratio of the medians, and the median of the per-round ratios (paired: steadier on a noisy machine)."""
        paired = statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))
        return medians[a] / medians[b], paired

    print(f"{LAYERS}-layer Qwen2 (hidden 256), batch 1, one token, CPU, {leaves} streamed leaves; median over "
          f"{args.rounds} rounds of each round's median of {args.iters} forwards, {torch.get_num_threads()} threads")
    for name, median in medians.items():
        of_median, paired = ratio(name, "unconverted")
        print(f"  {name:<18} {median * 1e3:8.3f} ms/forward   vs unconverted {of_median:6.3f} (paired {paired:6.3f})")
    for name in ("specific resident", "generic resident"):
        of_median, paired = ratio(name, "unconverted")
        print(f"{name} fast path: {of_median - 1:+.1%} over unconverted (paired {paired - 1:+.1%}; goal <= +3%): "
              f"{'met' if of_median <= 1.03 else 'NOT met'}")
    of_median, paired = ratio("generic fetching", "specific fetching")
    per_leaf = statistics.median(g - s for g, s in zip(samples["generic fetching"], samples["specific fetching"],
                                                         strict=True)) / leaves
    print(f"generic fetching vs specific fetching: {of_median:.3f}x (paired {paired:.3f}x), "
          f"{per_leaf * 1e6:+.2f} us per leaf (median of the per-round differences)")
    of_median, paired = ratio("generic resident", "specific resident")
    print(f"generic resident vs specific resident: {of_median:.3f}x (paired {paired:.3f}x)")


if __name__ == "__main__":
    with recorded("generic"):
        main()
