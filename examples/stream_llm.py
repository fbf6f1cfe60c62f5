"""Stream a transformers LLM within a memory budget, without ComfyUI.

Builds a small Qwen2 (random weights, no download), saves it, loads it back into a skeleton with
the shipped `decoder-llm` policy, keeps what fits the budget on the compute device and streams
the rest, then generates. Point --model at a Hugging Face folder to use a real checkpoint.

    python examples/stream_llm.py [--device cuda] [--budget 64MiB|50%|auto] [--policy NAME|FILE|auto] [--model FOLDER]
                                  [--measure]

`--measure` places the streamed blocks by the compute of one measuring forward of the prompt (on a GPU).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import streamwise
from streamwise.runtime.checkpoint import CheckpointError
from streamwise.runtime.hosts.standalone import OffloadError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", default="1MiB", help="bytes, a size (64MiB, 1.5GB), a share (50%%) or auto")
    parser.add_argument("--policy", default="decoder-llm", help="a policy name, a policy file, or auto")
    parser.add_argument("--model", help="a Hugging Face folder (config.json + safetensors)")
    parser.add_argument("--measure", action="store_true", help="spread the streamed blocks along a measured forward")
    args = parser.parse_args()
    try:
        run(args)
    except (streamwise.PolicyError, CheckpointError, OffloadError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model
        if folder is None:
            config = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
            torch.manual_seed(0)
            transformers.Qwen2ForCausalLM(config).save_pretrained(scratch)
            folder = scratch
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
        with streamwise.skeleton():
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
        streamwise.load(model, folder, args.policy, progress=lambda done, total: None)

        def prompt() -> torch.Tensor:  # made once offload has checked the device
            return torch.tensor([[1, 2, 3, 4]], device=args.device)

        report = streamwise.offload(model, args.policy, device=args.device, budget=args.budget,
                                    measure=(lambda m: m(prompt())) if args.measure else None)
        print(report)
        with torch.no_grad():
            tokens = model.generate(prompt(), max_new_tokens=12, do_sample=False)
        print("generated token ids:", tokens[0].tolist())


if __name__ == "__main__":
    main()
