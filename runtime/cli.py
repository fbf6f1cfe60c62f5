"""`policy-validate`: check policy files and print located diagnostics.

Exit status: 0 when every policy is valid (warnings allowed), 1 when any has errors, 2 on usage
errors. With no arguments it checks the user policy folders (`$STREAMWISE_POLICY_PATH`) and the
shipped policies. It never imports torch, so it answers fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .catalog import policy_dirs
from .diagnostics import Diagnostic, render_json, render_text
from .loading import check_policy
from .source import display_path

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="policy-validate",
        description="Validate Streamwise policy files. With no PATHS, check the user and shipped policies.",
    )
    parser.add_argument("paths", nargs="*", metavar="PATHS", help="policy files, or folders of *.toml files")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only problems and the summary")
    args = parser.parse_args(argv)

    try:
        files = _collect(args.paths)
    except FileNotFoundError as missing:
        parser.print_usage(sys.stderr)
        print(f"policy-validate: error: no such file or folder: {missing}", file=sys.stderr)
        return EXIT_USAGE

    reports = {display_path(path): check_policy(path)[1] for path in files}
    if args.format == "json":
        print(render_json(reports))
    else:
        _print_text(reports, quiet=args.quiet)
    return EXIT_PROBLEMS if any(d.is_error for ds in reports.values() for d in ds) else EXIT_OK


def _collect(paths: Sequence[str]) -> list[Path]:
    if not paths:
        return [f for folder in policy_dirs() if folder.is_dir() for f in sorted(folder.glob("*.toml"))]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(path.rglob("*.toml"))
        elif path.exists():
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
    failed = sum(any(d.is_error for d in ds) for ds in reports.values())
    if not reports:
        print("no policy files found")
    elif errors:
        print(f"{failed} of {len(reports)} policies invalid: {_count(errors, 'error')}, {_count(warnings, 'warning')}")
    else:
        print(f"{len(reports)} {'policy' if len(reports) == 1 else 'policies'} valid" + (f", {_count(warnings, 'warning')}" if warnings else ""))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


if __name__ == "__main__":
    sys.exit(main())
