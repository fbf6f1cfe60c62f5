"""The smallest memory headroom a load survives, Streamwise beside transformers on the same folder, standalone and in
a ComfyUI server.

Headroom is a memory cgroup's limit less what the process holds of its own before it loads (the cgroup's use less its
file pages: a library's page cache is charged to whichever cgroup read it first, and is the kernel's to drop). Each
trial is a fresh process in a fresh cgroup under this one's own (v1 `memory.limit_in_bytes` with swap, or v2
`memory.max`); once it is idle, the limit becomes its usage plus the headroom, and it loads the float32 Qwen2 folder
and generates greedy tokens. The model's files are evicted from the page cache first, so it reads them cold and is
charged for what it reads.

- Standalone: a child that has imported torch, transformers with the model's modeling code, and Streamwise (what
  both loaders import lazily otherwise, counted in neither's figure) loads with `from_pretrained`, or
  `load_pretrained(folder, "auto")` with its default host budget (which reads the limit), and generates 8 tokens from
  a 16-token prompt.
- `--server`: the core at COMFYUI_ROOT, started as tests/comfy/test_server.py starts it (the pack and the example
  models), its models folder holding the same model with a word-level tokenizer and a chat template
  (tests/comfy/test_server_memory.py); idle once it answers (`transformers_node.py`, linked into its custom_nodes,
  imported transformers, the modeling code and Streamwise as it started). It runs the shipped Generate Text workflow
  (the pack's loader, `auto`), or the bench's node calling transformers' own `from_pretrained` + `generate`.

A trial ends `ok` (each loader's tokens or text must be transformers' unlimited ones), `refused` (Streamwise's
CheckpointError: it says what it needs), `killed` (the OOM killer) or `timeout` (past `--timeout`: thrashing). The
search halves the interval between a failing and a surviving headroom down to `--resolution`, the two loaders
interleaved at each step, then runs the boundary pair `--repeat` times more. The model: hidden 1024, intermediate
2816, 8 layers, vocabulary 32000 (its embedding, 125 MiB, is a fifth of an untied model's bytes and more of a tied
one's), tied and untied.

    python benchmarks/bench_headroom.py [--variants tied,untied] [--resolution 8] [--repeat 2] [--timeout 600]
    COMFYUI_ROOT=/path/to/ComfyUI python benchmarks/bench_headroom.py --server [...]

Results: `benchmarks/results/headroom-DATE.md`, or `headroom_server-DATE.md` (`report.recorded`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from bench_memory_tiers import evict, memory_cgroup, remove_cgroup  # this folder's
from report import recorded

REPO = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/streamwise-bench-headroom")
SIZES = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000)
CHILD = r"""
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: F401  (the modeling code, imported first)
from streamwise import load_pretrained
from streamwise.runtime.checkpoint import CheckpointError

loader, folder = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
ids = torch.randint(0, 32000, (1, 16))
print("IDLE", flush=True)
sys.stdin.readline()
if loader == "transformers":
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    said = ""
else:
    try:
        loaded = load_pretrained(folder, "auto", progress=False)
    except CheckpointError as exc:
        print("REFUSED", json.dumps(str(exc)), flush=True)
        sys.exit(1)
    model, said = loaded.model, str(loaded.report.tiers)
with torch.no_grad():
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
print("DONE", json.dumps({"tokens": tokens[0, 16:].tolist(), "tiers": said}), flush=True)
"""
REFUSAL = "loading needs at least"  # the start of Streamwise's refusal for memory


class TrialCgroup:
    """A fresh memory cgroup under this process's own: what its processes use (less file pages), and its limit."""

    def __init__(self, version: str, path: Path):
        self.version, self.path = version, path

    def enter(self) -> None:
        """Move the calling process in (a child's `preexec_fn`)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        used = int((self.path / ("memory.usage_in_bytes" if self.version == "v1" else "memory.current")).read_text())
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        prefix = "total_" if self.version == "v1" else ""
        return used - int(stat[prefix + "active_file"]) - int(stat[prefix + "inactive_file"])

    def limit_headroom(self, headroom_mib: float) -> int:
        """Limit the cgroup to its usage now plus `headroom_mib`; that usage (the idle process's)."""
        idle = self.usage()
        limit = (idle + int(headroom_mib * 2**20) + 4095) // 4096 * 4096
        names = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"] if self.version == "v1" else ["memory.max"]
        for name in names:
            if (self.path / name).exists():
                (self.path / name).write_text(str(limit))
        return idle


@contextlib.contextmanager
def trial_cgroup() -> Iterator[TrialCgroup]:
    found = memory_cgroup()
    if found is None:
        raise SystemExit("no memory cgroup to make trials' cgroups under")
    version, parent = found
    group = parent / f"swbench-headroom-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield TrialCgroup(version, group)
    finally:
        remove_cgroup(group)


def make_model(variant: str) -> Path:
    import torch
    import transformers

    folder = WORK / f"qwen2-{variant}"
    if not (folder / "model.safetensors").is_file():
        torch.manual_seed(0)
        config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=variant == "tied")
        transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def standalone_trial(folder: Path, timeout: float, loader: str, headroom_mib: float) -> dict:
    """One child under idle + `headroom_mib`: its outcome, the idle usage and what it printed last."""
    with trial_cgroup() as group:
        evict(folder)
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, "-c", CHILD, loader, str(folder)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=group.enter)
        while not child.stdout.readline().startswith("IDLE"):
            pass
        idle = group.limit_headroom(headroom_mib)
        child.stdin.write("go\n")
        child.stdin.flush()
        try:
            output, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return {"outcome": "timeout", "idle": idle, "seconds": None}
    lines = output.strip().splitlines() or [""]
    done = [json.loads(line[5:]) for line in lines if line.startswith("DONE ")]
    refused = [json.loads(line[8:]) for line in lines if line.startswith("REFUSED ")]
    seconds = time.monotonic() - started
    if done:
        (found,) = done
        return {"outcome": "ok", "idle": idle, "seconds": seconds, "output": found["tokens"], "said": found["tiers"]}
    if refused:
        return {"outcome": "refused", "idle": idle, "seconds": seconds, "said": refused[0]}
    outcome = "killed" if child.returncode == -9 else f"exit {child.returncode}"
    return {"outcome": outcome, "idle": idle, "seconds": seconds, "said": lines[-1][-300:]}


class ServerTrials:
    """A ComfyUI base folder with the pack, the bench's transformers node and the model; each trial a fresh server."""

    def __init__(self, root: Path, variant: str, timeout: float):
        sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "comfy")]
        from helpers import module_from_file

        self.harness = module_from_file(REPO / "tests" / "comfy" / "test_server.py")
        memory_tests = module_from_file(REPO / "tests" / "comfy" / "test_server_memory.py")
        self.root, self.timeout = root, timeout
        self.base = Path(tempfile.mkdtemp(prefix=f"server-{variant}-", dir=WORK))
        self.paths = self.harness.prepared(root, self.base)
        node = Path(__file__).with_name("transformers_node.py")
        (self.base / "custom_nodes" / node.name).symlink_to(node)
        self.folder = memory_tests.fifth_embedding_model(self.base / "models", tied=variant == "tied")
        streamwise = self.harness.workflow("streamwise_generate_text")
        streamwise["1"]["inputs"]["model"] = f"streamwise/{self.folder.name}"
        asked = {key: streamwise["2"]["inputs"][key] for key in ("prompt", "system", "chat", "max_new_tokens")}
        self.graphs = {"streamwise": streamwise, "transformers": {
            "2": {"class_type": "TransformersGenerateText", "inputs": {"folder": str(self.folder), **asked}}}}

    def __call__(self, loader: str, headroom_mib: float) -> dict:
        """One server under idle + `headroom_mib` running `loader`'s graph: its outcome, as standalone_trial's."""
        with trial_cgroup() as group:
            evict(self.folder)
            with self.harness.launched(self.root, self.base, self.paths, preexec_fn=group.enter) as server:
                idle = group.limit_headroom(headroom_mib)
                started = time.monotonic()
                try:
                    entry = server.wait(server.queue(self.graphs[loader]), timeout=self.timeout)
                except (AssertionError, OSError):  # past the timeout, or the server gone
                    gone = server.process.poll() is not None
                    return {"outcome": "killed" if gone else "timeout", "idle": idle, "seconds": None}
        seconds = time.monotonic() - started
        if entry["status"]["status_str"] == "success":
            return {"outcome": "ok", "idle": idle, "seconds": seconds, "output": entry["outputs"]["2"]["text"],
                    "said": " ".join(line for line in entry["outputs"].get("1", {}).get("text", [""])[0].splitlines()
                                     if "file" in line)}
        errors = [data["exception_message"] for kind, data in entry["status"]["messages"] if kind == "execution_error"]
        return {"outcome": "refused" if errors and REFUSAL in errors[0] else "error", "idle": idle, "seconds": seconds,
                "said": errors[0] if errors else json.dumps(entry["status"])[-300:]}


def search(run: Callable[[str, float], dict], resolution: float, repeat: int, expected, high: float) -> dict:
    """Each loader's boundary: the largest headroom failing and the smallest surviving, its outcomes there."""
    bounds = {loader: [0.0, high] for loader in ("transformers", "streamwise")}
    while any(high - low > resolution for low, high in bounds.values()):
        for loader, (low, high) in bounds.items():
            if high - low <= resolution:
                continue
            middle = (low + high) / 2
            result = run(loader, middle)
            survived = result["outcome"] == "ok"
            assert not survived or result["output"] == expected, (loader, result)  # the same output, or no figure
            bounds[loader][1 if survived else 0] = middle
            took = "" if result["seconds"] is None else f", {result['seconds']:.1f} s"
            print(f"  {loader:12} {middle:7.1f} MiB: {result['outcome']:8} (idle {result['idle'] / 2**20:.1f} MiB"
                  f"{took})", flush=True)
    found = {}
    for loader, (low, high) in bounds.items():
        repeats = [run(loader, headroom) for headroom in (low, high) for _ in range(repeat)]
        found[loader] = {"fails_at": low, "survives_at": high,
                         "repeats": [(r["outcome"], r["seconds"] and round(r["seconds"], 1), r.get("said", "")[:300])
                                     for r in repeats]}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="tied,untied")
    parser.add_argument("--server", action="store_true", help="trials in the ComfyUI server at COMFYUI_ROOT")
    parser.add_argument("--resolution", type=float, default=8.0, help="MiB")
    parser.add_argument("--high", type=float, default=1024.0, help="MiB: the search's first surviving bound")
    parser.add_argument("--repeat", type=int, default=2, help="runs at each side of a boundary after the search")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a trial may take")
    args = parser.parse_args()
    if args.server and not os.environ.get("COMFYUI_ROOT"):
        raise SystemExit("--server needs COMFYUI_ROOT: a ComfyUI checkout")
    WORK.mkdir(parents=True, exist_ok=True)
    with recorded("headroom_server" if args.server else "headroom"):
        for variant in args.variants.split(","):
            if args.server:
                run = ServerTrials(Path(os.environ["COMFYUI_ROOT"]), variant, args.timeout)
                folder = run.folder
            else:
                folder = make_model(variant)
                run = functools.partial(standalone_trial, folder, args.timeout)
            reference = run("transformers", 4096)
            assert reference["outcome"] == "ok", reference
            print(f"{variant}: {sum(p.stat().st_size for p in folder.glob('*.safetensors')) / 2**20:.1f} MiB file; "
                  f"output {reference['output']}", flush=True)
            found = search(run, args.resolution, args.repeat, reference["output"], args.high)
            for loader, figures in found.items():
                print(f"{variant} {loader}: fails at {figures['fails_at']:.1f} MiB, survives at "
                      f"{figures['survives_at']:.1f} MiB; boundary repeats: {figures['repeats']}", flush=True)


if __name__ == "__main__":
    main()
