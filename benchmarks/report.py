"""How benchmarks hand over their figures: the GPU ones print JSON and write it to `--out` (the device tool brings
that file back); the others record what they print in a dated result file under `results/`, headed by the command,
the commit, the machine and its load, so no figure is ever copied by hand."""

from __future__ import annotations

import datetime
import io
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def emit(results: dict, out: str | None) -> None:
    """Print `results` as indented JSON; write the same text to `out` where given."""
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")


def section(results: dict, name: str, run, *args) -> None:
    """`results[name] = run(*args)`, or the error it raised: one failing part of a GPU check never costs the
    figures of the others (a device lease is short)."""
    try:
        results[name] = run(*args)
    except Exception as exc:  # reported, not raised: the JSON must come back
        import traceback

        results[name] = {"error": "".join(traceback.format_exception(exc)[-6:])}


def git_commit() -> str | None:
    """The checkout's commit, marked where the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + (" (working tree modified)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    """CPUs, kernel, memory and CPU model, where the platform says them."""
    info: dict = {"cpus": os.cpu_count(), "kernel": platform.release()}
    for name, prefixes in (("/proc/meminfo", ("MemTotal", "MemAvailable")), ("/proc/cpuinfo", ("model name",))):
        try:
            lines = Path(name).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith(prefixes):
                key, value = (part.strip() for part in line.split(":", 1))
                if key == "model name":
                    info.setdefault("cpu", value)
                else:
                    info[key] = int(value.split()[0]) * 1024
    return info


def _load() -> str:
    try:
        return ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except (AttributeError, OSError):  # not on this platform
        return "unknown"


@contextmanager
def recorded(name: str, folder: Path = RESULTS) -> Iterator[None]:
    """Print as usual, and write what was printed to `folder/<name>-<date>.md` (`-2`, `-3`, ... after it where a run
    of the same day wrote that) when the run ends, headed by the command, the commit, torch's version, the machine and
    the load average before and after."""
    started, load_before, printed = datetime.datetime.now(datetime.UTC), _load(), io.StringIO()
    shown = sys.stdout  # where printing went before: a terminal, a pipe, a caller's capture

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            printed.write(text)
            return shown.write(text)

        def flush(self) -> None:
            shown.flush()

    with redirect_stdout(Tee()):
        yield
    import torch  # every benchmark here has imported it by now

    info = machine()
    memory = f", {info['MemTotal'] / 2**30:.1f} GiB RAM" if "MemTotal" in info else ""
    header = [
        f"# `python {' '.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])}`",
        "",
        f"- {started.isoformat(timespec='seconds')}, commit {git_commit()}",
        f"- torch {torch.__version__}, Python {platform.python_version()}; {info['cpus']} CPUs "
        f"({info.get('cpu', 'unknown')}){memory}, kernel {info['kernel']}",
        f"- load average {load_before} at start, {_load()} at end",
        "",
        "```",
    ]
    folder.mkdir(parents=True, exist_ok=True)
    path, again = folder / f"{name}-{started.date()}.md", 2
    while path.exists():  # an earlier run's figures of the same day stay: this one takes the next free name
        path, again = folder / f"{name}-{started.date()}-{again}.md", again + 1
    path.write_text("\n".join([*header, printed.getvalue().rstrip(), "```", ""]), encoding="utf-8")
    print(f"results written to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
