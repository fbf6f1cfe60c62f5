"""Wall time of `policy-validate` on the shipped policies, as a user runs it (a fresh process).

Target: under 0.3 s on the project's 2-core machine. Run:

    python benchmarks/bench_validate.py [--runs 20]
"""

from __future__ import annotations

import argparse
import compileall
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import recorded  # this folder's: results/<name>-<date>.md

TARGET_SECONDS = 0.3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    script = shutil.which("policy-validate", path=str(Path(sys.executable).parent)) or shutil.which("policy-validate")
    if script is None:
        print("policy-validate is not installed; run `pip install -e .` first", file=sys.stderr)
        return 2
    # An installed package has its bytecode compiled; an editable checkout under
    # PYTHONDONTWRITEBYTECODE would recompile every module on every run. Compile once, as pip does.
    import streamwise

    package = Path(streamwise.__file__).parent
    for folder in (package, *(package / name for name in ("runtime", "schemas"))):  # not build/ or tests/
        compileall.compile_dir(folder, quiet=1, maxlevels=0 if folder == package else 10)
    command = [script, "--quiet"]
    subprocess.run(command, check=True, capture_output=True)  # warm the file cache
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    baseline = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        baseline.append(time.perf_counter() - start)

    median = statistics.median(times)
    print(f"policy-validate --quiet (shipped policies), {args.runs} runs: "
          f"median {median:.3f} s, min {min(times):.3f} s, max {max(times):.3f} s")
    print(f"bare `python -c pass` for scale: median {statistics.median(baseline):.3f} s")
    print(f"target < {TARGET_SECONDS} s: {'met' if median < TARGET_SECONDS else 'NOT met'}")
    return 0 if median < TARGET_SECONDS else 1


if __name__ == "__main__":
    with recorded("validate"):
        status = main()
    sys.exit(status)
