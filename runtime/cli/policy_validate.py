"""`policy-validate`: check policy files and print located diagnostics.

- exit status 0 when every policy is valid (warnings allowed), 1 when any has errors (`errors_in`), 2 on usage
  errors, so CI can gate on it;
- with no arguments it checks the user policy folders (`$STREAMWISE_POLICY_PATH`) and the shipped policies;
- checking files never imports torch, so it answers fast (a test proves it in a fresh interpreter); only
  `--model SPEC POLICY`, which also resolves the policy against a model built on the meta device and prints the
  plan, imports the engine; `--model SPEC auto` prints the policy `auto` picks for that model, why, and its plan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..policy.diagnostics import Diagnostic, PolicyError, errors_in, json_report, render_json, render_text
from ..policy.folders import path_problem, policy_dirs, policy_files
from ..policy.load import check_policy
from ..policy.source import display_path
from .json_option import OptionError, json_option

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="policy-validate",
        description="Validate Streamwise policy files. With no PATHS, check the user and shipped policies.",
    )
    parser.add_argument("paths", nargs="*", metavar="PATHS", help="policy files, or folders of *.toml files")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only problems and the summary")
    parser.add_argument(
        "--model", metavar="SPEC",
        help="resolve one policy against a model built on the meta device: transformers:<Class>, "
        "transformers:<model_type> or module:factory",
    )
    parser.add_argument(
        "--model-config", metavar="JSON", help="config overrides for --model, e.g. '{\"num_hidden_layers\": 2}'"
    )
    args = parser.parse_args(argv)
    if args.model is not None:
        if len(args.paths) != 1:
            parser.error("--model takes exactly one policy (a name or a file)")
        return _check_against_model(parser, args)
    if args.model_config is not None:
        parser.error("--model-config needs --model")

    try:
        files = _collect(args.paths)
    except FileNotFoundError as missing:
        parser.print_usage(sys.stderr)
        print(f"policy-validate: error: no such file or folder: {missing}", file=sys.stderr)
        return EXIT_USAGE

    reports = {display_path(path): check_policy(path)[1] for path in files}
    _report(reports, args)
    return EXIT_PROBLEMS if any(errors_in(ds) for ds in reports.values()) else EXIT_OK


def _report(reports: dict[str, list[Diagnostic]], args: argparse.Namespace) -> None:
    if args.format == "json":
        print(render_json(reports))
    else:
        _print_text(reports, quiet=args.quiet)


def _check_against_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..builders.model_spec import ModelSpecError, build_model  # torch only from here on
    from ..plan.auto import AUTO, select_policy

    try:  # a usage error, so it is found before the policy is looked at
        model = build_model(args.model, json_option("--model-config", args.model_config))
    except (ModelSpecError, OptionError) as exc:
        parser.print_usage(sys.stderr)
        print(f"policy-validate: error: --model: {exc}", file=sys.stderr)
        return EXIT_USAGE
    chosen = None
    if args.paths[0] == AUTO:  # the policy `auto` picks for this model, and why
        try:
            choice = select_policy(model)
        except PolicyError as exc:
            policy, diagnostics = None, list(exc.diagnostics)
        else:
            policy, diagnostics, chosen = choice.policy, [], choice.reason
    else:
        policy, diagnostics = check_policy(args.paths[0])
    plan = None
    if policy is not None:
        from ..plan.resolve import resolve

        plan = resolve(policy, model)
        diagnostics = [*diagnostics, *plan.diagnostics]
    if args.format == "json":  # the file-grouped document of plain runs, plus the model and its plan
        print(json.dumps({**json_report({args.paths[0]: diagnostics}), "model": args.model, "chosen": chosen,
                          "plan": plan.summary() if plan is not None else None}, indent=2))
    elif plan is None:
        _print_text({args.paths[0]: diagnostics}, quiet=args.quiet)
    else:
        print(f"model: {args.model} (built on the meta device)" + (f"\n{chosen}" if chosen else "") + f"\n{plan}")
        if diagnostics:
            print("\n" + render_text(diagnostics))
    return EXIT_PROBLEMS if errors_in(diagnostics) else EXIT_OK


def _collect(paths: Sequence[str]) -> list[Path]:
    if not paths:
        return [f for folder in policy_dirs() for f in policy_files(folder)]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path_problem(raw) is not None:  # no filesystem call: reported as unreadable
            files.append(path)
        elif path.is_dir():
            files += sorted(path.rglob("*.toml"))
        elif os.path.lexists(path):  # a broken or looping symlink is there too: reported as unreadable
            files.append(path)
        else:
            raise FileNotFoundError(raw)
    return files


def _print_text(reports: dict[str, list[Diagnostic]], *, quiet: bool) -> None:
    for file, diagnostics in reports.items():
        if diagnostics:
            print(render_text(diagnostics), end="\n\n")
        elif not quiet:
            print(f"ok: {file}")
    every = [d for ds in reports.values() for d in ds]
    errors = sum(d.is_error for d in every)
    warnings = len(every) - errors
    failed = sum(errors_in(ds) for ds in reports.values())
    if not reports:
        print("no policy files found")
    elif errors:
        print(f"{failed} of {len(reports)} policies invalid: {_count(errors, 'error')}, {_count(warnings, 'warning')}")
    else:
        valid = f"{len(reports)} {'policy' if len(reports) == 1 else 'policies'} valid"
        print(valid + (f", {_count(warnings, 'warning')}" if warnings else ""))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


if __name__ == "__main__":
    sys.exit(main())
