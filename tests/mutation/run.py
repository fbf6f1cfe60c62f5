"""Mutation testing of the decision code: plausible bugs planted one at a time, each of which some test must catch.

For each module below, cosmic-ray (a well-kept mutation tester; `pip install -e ".[mutation]"`) plants, one at a time,
the bugs a reviewer would call plausible: a flipped or loosened comparison, `and` for `or`, a dropped `not`, `True`
for `False`, a changed constant (a tolerance, a limit), a `break` for a `continue`. It runs the module's own tests
against each and reports the mutants no test killed. It works on a private copy of the checkout (imported as
`streamwise` ahead of any installed one), so the tree and anything else using it are never touched. A developer runs
it before a stop; it is not part of CI, which it would not fit.

    python tests/mutation/run.py                     # every module (hours on 2 cores: engine/kinds.py alone has
                                                     # about 250 mutants at ~25 s each)
    python tests/mutation/run.py runtime/plan/auto.py # one module
    python tests/mutation/run.py --survivors [module ...]  # only the last run's survivors, against today's tests

Each run keeps its survivors (operator and occurrence) in `build/mutation/survivors.json`; `--survivors` plants just
those again, so the tests written to kill them are checked in minutes, not hours. The occurrences name places in the
module as it was when it was scored: after the module itself changes, score it anew.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# module -> the tests that state its behaviour (run against each of its mutants)
MODULES = {
    "runtime/plan/auto.py": ["tests/plan/test_auto_policy.py"],
    "runtime/plan/precedence.py": ["tests/plan/test_precedence.py"],
    "runtime/plan/selectors.py": ["tests/plan/test_selectors.py", "tests/plan/test_precedence.py"],
    "runtime/engine/kinds.py": [
        "tests/engine/test_kinds.py", "tests/engine/test_generic.py", "tests/engine/test_probe.py"],
    "runtime/engine/probe.py": ["tests/engine/test_probe.py"],
    "runtime/checkpoint/readers.py": ["tests/checkpoint/test_hostile_checkpoints.py"],
    "runtime/policy/limits.py": ["tests/policy/test_hostile_policies.py"],
}
# The plausible bugs: comparisons, boolean logic, negation, constants, loop control. Arithmetic swaps (every `+` as
# each of ten other operators) would multiply the run for mutants a reviewer would not call plausible.
KEEP = ["ReplaceComparisonOperator", "ReplaceAndWithOr", "ReplaceOrWithAnd", "AddNot", "ReplaceTrueWithFalse",
        "ReplaceFalseWithTrue", "NumberReplacer", "ReplaceBreakWithContinue", "ReplaceContinueWithBreak",
        "ZeroIterationForLoop", "ReplaceUnaryOperator_USub"]
TIMEOUT = 120.0  # seconds a mutant's tests may take (a mutant that loops forever is killed by it)
SURVIVORS = REPO / "build" / "mutation" / "survivors.json"  # by module: each survivor of its last run


def tool(name: str) -> str:
    """A cosmic-ray command: the one installed beside this Python (a venv need not be activated), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"`{name}` not found beside {sys.executable} or on PATH: pip install -e \".[mutation]\"")
    return found


def test_command(tests: list[str]) -> str:
    return " ".join([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", *tests])


def config(module: str, tests: list[str]) -> str:
    command = test_command(tests)
    exclude = "|".join(KEEP)
    return f"""[cosmic-ray]
module-path = "{module}"
timeout = {TIMEOUT}
excluded-modules = []
test-command = "{command}"

[cosmic-ray.distributor]
name = "local"

[cosmic-ray.filters.operators-filter]
exclude-operators = ["^(?!core/({exclude})).*"]
"""


def private_copy(folder: Path) -> Path:
    """The checkout copied to `folder/streamwise`: mutated there, imported from there (PYTHONPATH)."""
    copy = folder / "streamwise"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "build", "__pycache__", "*.egg-info"))
    return copy


def run(module: str, tests: list[str], folder: Path, copy: Path) -> dict:
    cfg, session = folder / f"{Path(module).stem}.toml", folder / f"{Path(module).stem}.sqlite"
    cfg.write_text(config(module, tests))
    env = {**os.environ, "PYTHONPATH": str(copy.parent)}
    for step in ([tool("cosmic-ray"), "init", cfg, session], [tool("cr-filter-operators"), session, cfg],
                 [tool("cosmic-ray"), "exec", cfg, session]):
        subprocess.run([str(part) for part in step], cwd=copy, env=env, check=True)
    dump = subprocess.run([tool("cosmic-ray"), "dump", str(session)], cwd=copy, capture_output=True, text=True,
                          check=True).stdout
    jobs = [json.loads(line) for line in dump.splitlines() if line.strip()]
    done = [(job, result) for job, result in jobs if result is not None and result.get("worker_outcome") == "normal"]
    survivors = [job for job, result in done if result["test_outcome"] == "survived"]
    return {"mutants": len(done), "killed": len(done) - len(survivors), "survivors": [
        {"line": m["start_pos"][0], "operator": m["operator_name"], "occurrence": m["occurrence"]}
        for job in survivors for m in job["mutations"]]}


def rerun(module: str, tests: list[str], copy: Path, survivors: list[dict]) -> dict:
    """Plant each survivor again (`cosmic-ray mutate-and-test`, which restores the module after) and run the tests."""
    env = {**os.environ, "PYTHONPATH": str(copy.parent)}
    left = []
    for survivor in survivors:
        step = [tool("cosmic-ray"), "mutate-and-test", module, survivor["operator"], str(survivor["occurrence"]),
                test_command(tests)]
        out = subprocess.run(step, cwd=copy, env=env, capture_output=True, text=True, check=True).stdout
        outcome = json.loads(out)
        if outcome.get("worker_outcome") == "normal" and outcome["test_outcome"] == "survived":
            left.append(survivor)
    return {"survivors": left, "killed": len(survivors) - len(left)}


def describe(module: str, survivor: dict) -> str:
    return f"{module}:{survivor['line']} {survivor['operator']} #{survivor['occurrence']}"


def main(argv: list[str]) -> int:
    again = argv[:1] == ["--survivors"]
    argv = argv[1:] if again else argv
    unknown = [module for module in argv if module not in MODULES]
    if unknown:
        raise SystemExit(f"not a module this script scores: {', '.join(unknown)} (choose from {', '.join(MODULES)})")
    chosen = {module: MODULES[module] for module in argv} if argv else MODULES
    kept = json.loads(SURVIVORS.read_text()) if SURVIVORS.exists() else {}
    started = time.monotonic()
    killed = total = 0
    with tempfile.TemporaryDirectory() as tmp:
        copy = private_copy(Path(tmp))
        for module, tests in chosen.items():  # each module's score as soon as it is known: a long run can stop
            if again:
                if module not in kept:
                    print(f"{module}: not scored yet (run it without --survivors first)", flush=True)
                    continue
                before = kept[module]["survivors"]
                result = rerun(module, tests, copy, before)
                kept[module].update(survivors=result["survivors"], killed=kept[module]["killed"] + result["killed"])
                print(f"{module}: {result['killed']} of the last run's {len(before)} survivors killed", flush=True)
                killed, total = killed + result["killed"], total + len(before)
            else:
                result = kept[module] = run(module, tests, Path(tmp), copy)
                score = result["killed"] / result["mutants"] if result["mutants"] else 1.0
                print(f"{module}: {result['killed']}/{result['mutants']} killed ({score:.0%})", flush=True)
                killed, total = killed + result["killed"], total + result["mutants"]
            for survivor in result["survivors"]:
                print(f"  survived: {describe(module, survivor)}", flush=True)
            SURVIVORS.parent.mkdir(parents=True, exist_ok=True)
            SURVIVORS.write_text(json.dumps(kept, indent=1))
    print(f"total: {killed}/{total} killed ({killed / max(total, 1):.0%}) in {time.monotonic() - started:.0f} s")
    return 0 if killed == total else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
