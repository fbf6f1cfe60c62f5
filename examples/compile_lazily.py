"""Convert a transformers model, arm lazy regional compile, and read what torch compiled.

    python examples/compile_lazily.py [--backend aot_eager|inductor] [--policy NAME|FILE]
"""

from __future__ import annotations

import argparse

import torch
import transformers

import streamwise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--policy", default="decoder-llm", help="a policy with [compile] blocks (a name or file)")
    args = parser.parse_args()
    try:
        policy = streamwise.load_policy(args.policy)
    except streamwise.PolicyError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    config = transformers.Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    streamwise.apply(streamwise.resolve(policy, model), model)
    streamwise.lazy_compile(model, policy, backend=args.backend)  # instant: nothing traced yet
    print("before the first forward:", streamwise.compile_stats(model))
    with torch.no_grad():
        # Without a KV cache the layers are interchangeable; a cache passes each layer's index,
        # which dynamo specializes on (one graph per layer, see README).
        model(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False)
    stats = streamwise.compile_stats(model)
    print(f"{stats.units} decoder layers share {stats.regions} compiled region(s): {stats.graphs} graph(s), "
          f"{stats.graph_breaks} graph breaks, {stats.compile_seconds:.2f} s compiling")


if __name__ == "__main__":
    main()
