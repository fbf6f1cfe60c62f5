"""The `streamwise` command: `demo`, `example-models DIR`, `quantize SRC DST [--policy NAME] [--type TYPE]` and
`policy draft`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ...schemas.vocabulary import GGUF_LAYOUTS, GGUF_WRITE_TYPES
from ..checkpoint.llama_quant_mix import MIXES
from ..checkpoint.readers import CheckpointError
from ..policy.diagnostics import PolicyError
from ..policy.load import load_policy
from ..sizes import human
from .json_option import OptionError, json_option


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamwise", description="Streamwise tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    quantize = commands.add_parser("quantize", help="write a .safetensors checkpoint as GGUF, types per the policy")
    quantize.add_argument("source", help="a .safetensors file, a shard index, or a Hugging Face folder")
    quantize.add_argument("destination", help="the .gguf file to write")
    quantize.add_argument(
        "--policy", default="auto",
        help="a policy name or file whose `gguf` quant rules pick the layers and types (default: auto)",
    )
    quantize.add_argument("--type", choices=(*GGUF_WRITE_TYPES, *MIXES), dest="gguf_type",
                          help="one GGML type for every layer the policy's gguf rules select; or Q4_K_M / Q5_K_M, "
                               "llama-quantize's per-tensor choices for every weight matrix it quantizes "
                               "(transformers models the gguf package names)")
    quantize.add_argument("--layout", choices=GGUF_LAYOUTS, default="auto",
                          help="llama.cpp: llama.cpp's names, metadata and tokenizer, as its converter writes them, so "
                               "that llama.cpp runs the file too (the architectures docs/quantization.md lists); "
                               "streamwise: the model's state-dict names (any model); auto (default): llama.cpp's "
                               "where it holds the model bit for bit. Both carry the model's config and tokenizer "
                               "files. A llama.cpp GGUF stays in its layout")
    quantize.add_argument("--model", help="model spec for class selectors (default: the folder's config.json)")
    quantize.add_argument("--model-config", metavar="JSON", help="config overrides for --model")
    commands.add_parser("demo", help="run the pipeline on small random models, offline, and print a report")
    examples = commands.add_parser(
        "example-models", help="write the tiny models the shipped workflows name into a ComfyUI models folder")
    examples.add_argument("models", help="ComfyUI's models folder (e.g. ComfyUI/models)")
    from .draft import add_commands  # `streamwise policy draft`

    add_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "policy":
        return args.run(args)
    if args.command == "example-models":
        from .example_models import write_example_models

        for path in write_example_models(args.models):
            print(f"wrote {path}")
        return 0
    if args.command == "demo":
        from .demo import run_demo

        results = run_demo()
        close = all(r["identical"] or r["relative_error"] < 0.05 for k, r in results.items() if k != "peak_rss_mib")
        return 0 if close else 1
    return _quantize(parser, args)


def _quantize(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..builders.model_spec import ModelSpecError, build_model
    from ..builders.skeleton import build_skeleton, config_folder
    from ..checkpoint.gguf_writer import quantize_to_gguf
    from ..checkpoint.llama_cpp import is_llama_cpp_file
    from ..checkpoint.readers import open_checkpoint

    try:
        overrides = json_option("--model-config", args.model_config)
    except OptionError as exc:
        parser.error(str(exc))
    try:
        policy = args.policy if args.policy == "auto" else load_policy(args.policy)
        if args.model:
            model = build_model(args.model, overrides)
        elif is_llama_cpp_file(open_checkpoint(args.source)):
            model = None  # requantized by llama.cpp's tensor names, in its layout
        else:  # the folder's config.json (beside a weight file too), or a builder another pack registered
            model = build_skeleton(config_folder(Path(args.source)))
        report = quantize_to_gguf(args.source, args.destination, policy, model, gguf_type=args.gguf_type,
                                  layout=args.layout)
    except (PolicyError, CheckpointError, ModelSpecError, OSError) as exc:
        print(f"streamwise quantize: {exc}", file=sys.stderr)
        return 1
    types = ", ".join(f"{name} x{count}" for name, count in report.types.items())
    print(f"wrote {report.file}: {report.tensors} tensors ({types}), {human(report.bytes_in)} -> "
          f"{human(report.bytes_out)}")
    print(_standing(report))
    if report.float_layers:
        listed = list(report.float_layers.items())
        print(f"warning: {len(listed)} weight matrices stay float:", file=sys.stderr)
        for name, why in listed[:_LISTED]:
            print(f"  {name}: {why}", file=sys.stderr)
        if len(listed) > _LISTED:
            print(f"  ... and {len(listed) - _LISTED} more", file=sys.stderr)
    return 0


_LISTED = 20


def _standing(report) -> str:
    """Which layout the file is in and whether it loads alone, for people: what it carries, and where it is listed."""
    carried = report.carried
    if report.layout == "llama.cpp":
        layout = ("it is in llama.cpp's layout (its tensor names, metadata and tokenizer): llama.cpp runs it, and "
                  "Streamwise builds the same model from its metadata")
        if report.tokenizer:
            layout += f"\ntokenizer: {report.tokenizer}\n"
        if not carried:  # a llama.cpp file requantized
            return layout.rstrip()
    elif report.not_llama_cpp:
        layout = f"it is in Streamwise's layout ({report.not_llama_cpp})"
    else:
        layout = "it is in Streamwise's layout"
    if "config.json" not in carried:
        return (f"{layout}; it carries no config.json (the source folder has none): it loads with the model's "
                "config.json beside it")
    files = [name for name in carried if name not in ("config.json", "generation_config.json")]
    said = f"and its tokenizer ({', '.join(files)})" if files else "and no tokenizer (the folder has none)"
    return (f"{layout}; it carries config.json {said}: it loads alone (`load_pretrained(file)`; the ComfyUI loader "
            "lists it anywhere under models/streamwise, models/LLM or models/text_encoders)")


if __name__ == "__main__":
    sys.exit(main())
