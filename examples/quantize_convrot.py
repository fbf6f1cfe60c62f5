"""Quantize a checkpoint to ConvRot INT8 on load, save it in ComfyUI's `.comfy_quant` convention,
and load that file back.

    python examples/quantize_convrot.py [--group-size 16] [--policy NAME|FILE]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import safetensors.torch
import torch
import transformers

import streamwise
from streamwise.runtime.checkpoint import comfy_quant
from streamwise.schemas import Policy

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512)


def convrot_policy(group_size: int, base: str = "decoder-llm") -> Policy:
    """The `base` policy (the shipped decoder policy) plus ConvRot INT8 for every Linear but the output head."""
    base = streamwise.load_policy(base)
    quant = Policy.model_validate({
        "schema_version": 1, "policy": {"name": "convrot"},
        "quant": {
            "exclude": {"path": "lm_head"},
            "rule": [
                {"id": "linears", "select": {"class": "Linear"}, "format": "convrot_int8", "group_size": group_size},
            ],
        },
    }).quant
    return base.model_copy(update={"quant": quant})


def skeleton() -> torch.nn.Module:
    with streamwise.skeleton():
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--policy", default="decoder-llm", help="the policy to add ConvRot INT8 to (a name or file)")
    args = parser.parse_args()
    try:
        policy = convrot_policy(args.group_size, args.policy)
    except streamwise.PolicyError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    torch.manual_seed(0)
    original = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG)).eval()
    tokens = torch.tensor([[5, 6, 7, 8]])
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        original.save_pretrained(folder)
        quantized = skeleton()
        report = streamwise.load(quantized, folder, policy)
        print("quantized on load:", report.residents)
        target = Path(folder) / "model-convrot-int8.safetensors"
        safetensors.torch.save_file(comfy_quant.state_dict(quantized), target)
        reloaded = skeleton()
        print("reloaded from .comfy_quant:", streamwise.load(reloaded, target, args.policy).residents)
        expected, first, second = original(tokens).logits, quantized(tokens).logits, reloaded(tokens).logits
        print(f"relative error vs float: {float((first - expected).norm() / expected.norm()):.4f}; "
              f"reloaded identical: {torch.equal(first, second)}; "
              f"file {target.stat().st_size} B vs float {(Path(folder) / 'model.safetensors').stat().st_size} B")


if __name__ == "__main__":
    main()
