"""`streamwise policy draft`: the command over `plan.draft` (arguments, the output file, messages)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...schemas.patterns import is_policy_name
from ..plan.draft import COMMAND, DraftError, draft_policy
from .json_option import OptionError, json_option


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register `policy draft` on the `streamwise` command's subcommands; the parsed arguments' `run` runs it."""
    policy = commands.add_parser("policy", help="policy tools (`streamwise policy draft`)")
    tools = policy.add_subparsers(dest="policy_command", required=True)
    draft = tools.add_parser(
        "draft", help="write a commented policy for a model no policy knows, stranding nothing",
        description="Draft a policy for a model: one stream rule per compute kind (proven kinds, else generic), "
        "relocate rules for buffer-only modules, the model's declared compile blocks and a commented quant example.",
    )
    draft.add_argument("--model", required=True, metavar="SPEC",
                       help="transformers:<Class>, transformers:<model_type> or module:factory (built on meta)")
    draft.add_argument("--model-config", metavar="JSON",
                       help="config overrides for --model, e.g. '{\"num_hidden_layers\": 2}'")
    draft.add_argument("-o", "--output", metavar="FILE",
                       help="write the policy here (default: print it); its name is the file name")
    draft.add_argument("--name", help="the policy name (default: the file name, else from the root class)")
    draft.add_argument("--force", action="store_true", help="overwrite FILE when it exists")
    draft.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..builders.model_spec import ModelSpecError, build_model

    try:
        output = Path(args.output) if args.output else None
        name = args.name
        if name is not None and not is_policy_name(name):
            raise DraftError(f"--name `{name}` is not a valid policy name: use letters, digits, `_`, `-` and `.`")
        if output is not None:
            if output.suffix != ".toml":
                raise DraftError(f"{output}: a policy file's name ends in .toml")
            if name is not None and name != output.stem:
                raise DraftError(f"--name `{name}` differs from the file name `{output.stem}`; a policy's name "
                                 "must equal its file name")
            if not is_policy_name(output.stem):
                raise DraftError(f"{output}: `{output.stem}` is not a valid policy name (the file name without "
                                 ".toml): use letters, digits, `_`, `-` and `.`")
            name = output.stem
            if output.exists() and not args.force:
                raise DraftError(f"{output} exists; pass --force to overwrite it")
        model = build_model(args.model, json_option("--model-config", args.model_config))
        text = draft_policy(model, name=name, spec=args.model)
        if output is None:
            sys.stdout.write(text)
            return 0
        output.write_text(text, encoding="utf-8")
    except OptionError as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        return 1
    except (DraftError, ModelSpecError, OSError) as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        return 1
    print(output)
    return 0
