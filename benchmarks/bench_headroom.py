"""The smallest memory headroom a load survives, Streamwise beside transformers on the same folder.

Headroom is a memory cgroup's limit less what the process holds of its own before it loads (the cgroup's use less its
file pages: a library's page cache is charged to whichever cgroup read it first, and is the kernel's to drop): torch,
transformers with the model's modeling code, and streamwise imported (what both loaders import lazily otherwise,
counted in neither's figure). Each trial is a fresh child in a fresh cgroup under this process's own (v1
`memory.limit_in_bytes` with swap, or v2 `memory.max`): it imports, reports its usage, waits while the parent sets
the limit to that usage plus the headroom, then loads the float32 Qwen2 folder (`from_pretrained`, or
`load_pretrained(folder, "auto")` with its default host budget, which reads the limit) and generates 8 greedy tokens
from a 16-token prompt. The model file is evicted from the page cache first, so each child reads it cold and is
charged for what it reads.

A trial ends `ok` (the tokens: each loader's must be transformers' unlimited ones), `refused` (Streamwise's
CheckpointError: it says what it needs), `killed` (the OOM killer) or `timeout`. The search halves the interval
between a failing and a surviving headroom down to `--resolution`, the two loaders interleaved at each step, then
runs the boundary pair `--repeat` times more. The model: hidden 1024, intermediate 2816, 8 layers, vocabulary 32000
(its embedding, 125 MiB, is a fifth of an untied model's bytes and more of a tied one's), tied and untied.

    python benchmarks/bench_headroom.py [--variants tied,untied] [--resolution 8] [--repeat 2]

Results: `benchmarks/results/headroom-DATE.md` (`report.recorded`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench_memory_tiers import evict, memory_cgroup, remove_cgroup  # this folder's
from report import recorded

WORK = Path("/tmp/streamwise-bench-headroom")
SIZES = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000)
TIMEOUT = 600
CHILD = r"""
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: F401  (the modeling code, imported first)
from streamwise import load_pretrained
from streamwise.runtime.checkpoint import CheckpointError

def usage():  # the cgroup's use less its file pages: a library's page cache is the kernel's to drop
    for line in open("/proc/self/cgroup"):
        _, controllers, path = line.strip().split(":", 2)
        if "memory" in controllers.split(",") or controllers == "":
            for root, name, files in (("/sys/fs/cgroup/memory", "memory.usage_in_bytes", "total_"),
                                      ("/sys/fs/cgroup", "memory.current", "")):
                try:
                    used = int(open(root + path + "/" + name).read())
                    stat = dict(line.split() for line in open(root + path + "/memory.stat"))
                except OSError:
                    continue
                return used - int(stat[files + "active_file"]) - int(stat[files + "inactive_file"])

loader, folder = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
ids = torch.randint(0, 32000, (1, 16))
print("IDLE", usage(), flush=True)
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


def make_model(variant: str) -> Path:
    import torch
    import transformers

    folder = WORK / f"qwen2-{variant}"
    if not (folder / "model.safetensors").is_file():
        torch.manual_seed(0)
        config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=variant == "tied")
        transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def trial(loader: str, folder: Path, headroom_mib: float) -> dict:
    """One child under idle + `headroom_mib`: its outcome, the idle usage, the limit and what it printed last."""
    found = memory_cgroup()
    if found is None:
        raise SystemExit("no memory cgroup to make trials' cgroups under")
    version, parent = found
    group = parent / f"swbench-headroom-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    limit_files = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"] if version == "v1" else ["memory.max"]
    evict(folder)
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", CHILD, loader, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    try:
        idle = None
        for line in child.stdout:
            if line.startswith("IDLE "):
                idle = int(line.split()[1])
                break
        limit = (idle + int(headroom_mib * 2**20) + 4095) // 4096 * 4096
        for name in limit_files:
            if (group / name).exists():
                (group / name).write_text(str(limit))
        child.stdin.write("go\n")
        child.stdin.flush()
        try:
            output, _ = child.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            child.kill()
            output, _ = child.communicate()
            return {"outcome": "timeout", "idle_mib": idle / 2**20}
        lines = output.strip().splitlines() or [""]
        done = [json.loads(line[5:]) for line in lines if line.startswith("DONE ")]
        refused = [json.loads(line[8:]) for line in lines if line.startswith("REFUSED ")]
        outcome = ("ok" if done else "refused" if refused else "killed" if child.returncode == -9
                   else f"exit {child.returncode}")
        return {"outcome": outcome, "idle_mib": round(idle / 2**20, 1), "seconds": round(time.monotonic() - started, 1),
                **(done[0] if done else {}), **({"said": refused[0]} if refused else {}),
                **({"last": lines[-1][-300:]} if not done and not refused else {})}
    finally:
        remove_cgroup(group)


def search(folder: Path, resolution: float, repeat: int, expected: list[int]) -> dict:
    """Each loader's boundary: the largest headroom failing and the smallest surviving, its outcomes there."""
    bounds = {loader: [0.0, 1024.0] for loader in ("transformers", "streamwise")}
    while any(high - low > resolution for low, high in bounds.values()):
        for loader, (low, high) in bounds.items():
            if high - low <= resolution:
                continue
            middle = (low + high) / 2
            result = trial(loader, folder, middle)
            survived = result["outcome"] == "ok"
            assert not survived or result["tokens"] == expected, (loader, result)  # the same tokens, or no figure
            bounds[loader][1 if survived else 0] = middle
            print(f"  {loader:12} {middle:7.1f} MiB: {result['outcome']:8} (idle {result['idle_mib']} MiB"
                  f"{', ' + str(result['seconds']) + ' s' if 'seconds' in result else ''})", flush=True)
    found = {}
    for loader, (low, high) in bounds.items():
        repeats = [trial(loader, folder, headroom) for headroom in (low, high) for _ in range(repeat)]
        found[loader] = {"fails_at": low, "survives_at": high,
                         "repeats": [(r["outcome"], r.get("seconds"), r.get("said", r.get("tiers", ""))[:300])
                                     for r in repeats]}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="tied,untied")
    parser.add_argument("--resolution", type=float, default=8.0, help="MiB")
    parser.add_argument("--repeat", type=int, default=2, help="runs at each side of a boundary after the search")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    with recorded("headroom"):
        for variant in args.variants.split(","):
            folder = make_model(variant)
            reference = trial("transformers", folder, 4096)
            assert reference["outcome"] == "ok", reference
            print(f"{variant}: {sum(p.stat().st_size for p in folder.glob('*.safetensors')) / 2**20:.1f} MiB file; "
                  f"tokens {reference['tokens']}", flush=True)
            found = search(folder, args.resolution, args.repeat, reference["tokens"])
            for loader, figures in found.items():
                print(f"{variant} {loader}: fails at {figures['fails_at']:.1f} MiB, survives at "
                      f"{figures['survives_at']:.1f} MiB; boundary repeats: {figures['repeats']}", flush=True)


if __name__ == "__main__":
    main()
