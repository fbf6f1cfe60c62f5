"""Memory tiers (#33): load, first forward and peak memory of `load_pretrained` beside transformers and a raw read.

A float32 Qwen2ForCausalLM of at least `--size-gb` GiB (random weights, `torch.manual_seed(0)`, untied embeddings)
is written once with `save_pretrained` into `--workdir` and reused while its recorded config matches. Every
measurement runs in a fresh process (this script with `--child MODE`), rounds interleaved (A B C C B A ...), each
round once with the checkpoint in the page cache (warm: read once before) and once evicted from it (cold:
`POSIX_FADV_DONTNEED` on every file of the folder, checked with `fincore` where it exists). Modes:

- `transformers`: `AutoModelForCausalLM.from_pretrained(folder, dtype=float32)`, then one forward of `--tokens`.
- `streamwise`: `streamwise.load_pretrained(folder, "auto")` with the default host budget, then one forward: the
  host tier is the file's page cache under a read lease (`runtime/checkpoint/leased.py`) where Linux grants one.
- `streamwise-copied`: the same with `STREAMWISE_LEASE=0`: the host tier copied into memory of the process's own
  (Windows, macOS, a network file system).
- `streamwise-half`: `max_memory={"cpu": half the checkpoint + the staging buffers}`, so about half the weights
  stay on the file tier; a first forward (it learns the order the read-ahead follows), then the steady forward
  timed; in cold rounds the checkpoint is evicted again and a third, cold steady forward timed. Its host tier is
  copied (`STREAMWISE_LEASE=0`): a leased one is page cache the eviction would drop too, and the forward would then
  read more than the file tier's bytes that the raw read it is compared with reads.
- `raw-read`: the whole checkpoint read sequentially with `readinto` into one reused 64 MiB buffer.
- `raw-read-half`: the same, for as many bytes as the half-budget load left on the file tier.
- `raw-copy`: the whole checkpoint read into fresh anonymous memory of its own, 64 MiB chunks over as many threads as
  a load reads with: the floor of any private copy (the page faults of fresh memory included), which the host tier
  needs for its guarantee and transformers' memory map does not pay.

Streamwise's modules are byte-compiled first, as an installed package's are. Each child reports the time from its
spawn to the end of its imports, to its load, to its first forward (and the CPU seconds of the load, steadier than
wall time on a shared machine), the steady forward with `--tokens` and with one token (a decode step's: reads
dominate, not compute); its memory after the imports (the baseline) and the peaks of RssAnon / RssFile / VmRSS
sampled every 10 ms (/proc/self/status), VmHWM at the end; `report.tiers` for the streamwise modes; a checksum of
the logits (every loader must compute the same numbers). Goals (#33): first forward <= 1.0x transformers' (warm and
cold); a file-tier forward <= 1.5x the raw read of the bytes it streams; peak anonymous memory above the import
baseline <= host budget + the largest unit + 10%.

`--cgroup-limit 0.5,0.75` also runs each loader under a memory cgroup (v1 `memory.limit_in_bytes` or v2
`memory.max`, made under this process's own cgroup and removed after) limited to those multiples of the checkpoint,
and reports exit codes (-9: killed, the OOM killer), the last line each child printed and the cgroup's peak usage.
Cold is the honest cache state there: cgroup v1 charges a page to whoever read it first, so in a warm run the
parent's page cache is charged to the parent, not to the child. Results go to
`benchmarks/results/memory_tiers-DATE.{json,md}` (`memory_tiers-cgroup-DATE` with `--no-timing`; `--quick`: a
~200 MB model, results in the workdir), the raw JSON rewritten after every child. `--threads 1` keeps a busy
shared machine from stalling torch's OpenMP threads on each other (on a 2-core VM with other work running, a
2-thread forward took 1.4 s where a 1-thread one took 0.11 s). Run:

    python benchmarks/bench_memory_tiers.py [--quick] [--size-gb 2] [--rounds 3] [--threads 1] [--workdir DIR]
        [--cgroup-limit 0.2,0.35,0.5,0.75,1.0 [--cgroup-states cold] [--no-timing]] [--out BASE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import mmap
import os
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from report import git_commit, machine  # this folder's

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BUFFER = 64 << 20  # the raw read's reused buffer
MARK = "BENCH-RESULT "  # the line a child prints its JSON on

FULL = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
QUICK = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)
LOAD_MODES = ("transformers", "streamwise", "streamwise-copied", "streamwise-half")
MODES = (*LOAD_MODES, "raw-read", "raw-read-half", "raw-copy")
READERS = 4  # a load's reader threads at most (`runtime/checkpoint/tiers.READERS`)
FIRST_FORWARD_GOAL, FILE_TIER_GOAL, ANON_SLACK = 1.0, 1.5, 0.10


# --- the model ---------------------------------------------------------------------------------------------------


def layer_bytes(config: dict) -> int:
    """float32 bytes of one Qwen2 decoder layer (q/k/v with biases, o, the MLP, two norms)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    return 4 * (h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h)


def model_config(size_gib: float, quick: bool) -> dict:
    """The config of a model of at least `size_gib` GiB: the layers that pass it after the two embeddings."""
    config = dict(QUICK if quick else FULL)
    fixed = 4 * (2 * config["vocab_size"] * config["hidden_size"] + config["hidden_size"])
    layers = max(1, math.ceil((size_gib * 2**30 - fixed) / layer_bytes(config)))
    return dict(config, num_hidden_layers=layers, tie_word_embeddings=False, torch_dtype="float32")


BUILD = r"""
import json, sys, torch, transformers
torch.manual_seed(0)
config = json.loads(sys.argv[2])
config.pop("torch_dtype")
model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)).float()
model.save_pretrained(sys.argv[1])
"""


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def ensure_model(workdir: Path, config: dict) -> Path:
    """The model folder under `workdir`, written unless the one there was built from `config`."""
    name = f"qwen2-{config['num_hidden_layers']}x{config['hidden_size']}"
    folder, marker = workdir / name, workdir / f"{name}.json"
    if marker.is_file() and json.loads(marker.read_text()) == config and weight_files(folder):
        print(f"reusing {folder}", flush=True)
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    marker.unlink(missing_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"writing a {config['num_hidden_layers']}-layer model to {folder} ...", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", BUILD, str(folder), json.dumps(config)], check=True)
    os.sync()
    marker.write_text(json.dumps(config))
    print(f"written in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


def header_units(folder: Path) -> tuple[int, int]:
    """The checkpoint's tensor bytes and its largest module (a streamed unit of `decoder-llm`: one leaf each)."""
    units: dict[str, int] = {}
    for path in weight_files(folder):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                module = key.rpartition(".")[0]
                units[module] = units.get(module, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
    return sum(units.values()), max(units.values())


# --- the page cache ----------------------------------------------------------------------------------------------


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (no root needed: the pages are clean)."""
    for path in sorted(folder.iterdir()):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def warm(folder: Path) -> None:
    """Read every file of the folder once, so the page cache holds it."""
    buffer = bytearray(BUFFER)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass


def cached_bytes(folder: Path) -> int | None:
    """Bytes of the weight files in the page cache (`fincore`), None where it cannot tell."""
    if shutil.which("fincore") is None:
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES",
                              *map(str, weight_files(folder))], capture_output=True, text=True, check=True).stdout
        return sum(int(word) for word in out.split())
    except (subprocess.CalledProcessError, ValueError):
        return None


# --- a child: one measurement ------------------------------------------------------------------------------------


SOURCES = ("runtime/checkpoint/tiers.py", "runtime/checkpoint/fill.py", "runtime/checkpoint/checked_file.py",
           "runtime/engine/file_tier.py", "runtime/host_memory.py")
"""streamwise's files a child's numbers depend on most: hashed at its start (others edit the tree meanwhile)."""


def source_hashes() -> dict[str, str]:
    import hashlib

    return {name: hashlib.sha1((REPO / name).read_bytes()).hexdigest()[:10] for name in SOURCES
            if (REPO / name).is_file()}


def status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                values[key] = int(rest.split()[0]) * 1024
    return values


class Sampler(threading.Thread):
    """The peaks of /proc/self/status's VmRSS, RssAnon and RssFile, sampled every 10 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = status()
        self.samples = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.01):
            self.take()

    def take(self) -> None:
        now = status()
        self.samples += 1
        for key, value in now.items():
            self.peak[key] = max(self.peak.get(key, 0), value)

    def stop(self) -> dict[str, int]:
        self.halt.set()
        self.join()
        self.take()
        return self.peak


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread's, user and system (less sensitive to a busy machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def raw_read(files: list[Path], limit: int | None) -> int:
    """Read the files in order, `limit` bytes in all (None: every byte), into one reused buffer; the bytes read."""
    buffer = bytearray(BUFFER)
    view, done = memoryview(buffer), 0
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while limit is None or done < limit:
                want = BUFFER if limit is None else min(BUFFER, limit - done)
                count = handle.readinto(view[:want])
                if not count:
                    break
                done += count
    return done


def child(args: argparse.Namespace) -> None:
    mode, folder, spawn = args.child, Path(args.folder), args.spawn_time
    result: dict = {"mode": mode, "sources": source_hashes()}
    if mode.startswith("raw-"):
        imported = time.time()
        base = status()
        sampler = Sampler()
        sampler.start()
        start, cpu = time.perf_counter(), cpu_seconds()
        if mode == "raw-copy":
            nbytes = raw_copy(weight_files(folder))
        else:
            nbytes = raw_read(weight_files(folder), args.file_bytes if mode == "raw-read-half" else None)
        seconds = time.perf_counter() - start
        result.update(import_s=imported - spawn, read_s=seconds, read_bytes=nbytes, read_GBps=nbytes / seconds / 1e9,
                      read_cpu_s=cpu_seconds() - cpu)
    else:
        import torch
        from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: F401  (the modeling code too)

        if mode != "transformers":
            if mode in ("streamwise-copied", "streamwise-half"):
                os.environ["STREAMWISE_LEASE"] = "0"
            import streamwise
            from streamwise import load_pretrained  # noqa: F401  (the loader's code too, as transformers' above)
        if args.threads:
            torch.set_num_threads(args.threads)
        imported, cpu_imported = time.time(), cpu_seconds()
        base = status()
        sampler = Sampler()
        sampler.start()
        torch.manual_seed(1)
        tokens = torch.randint(0, args.vocab, (1, args.tokens))

        def forward(model, count: int = args.tokens) -> tuple[float, torch.Tensor]:
            start = time.perf_counter()
            with torch.inference_mode():
                logits = model(tokens[:, :count], use_cache=False).logits
            return time.perf_counter() - start, logits

        if mode == "transformers":
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
            model.eval()
        else:
            max_memory = {"cpu": args.budget} if mode == "streamwise-half" else None
            loaded = streamwise.load_pretrained(folder, "auto", max_memory=max_memory, progress=False)
            model, report = loaded.model, loaded.report
            tiers = report.tiers
            result["tiers"] = {key: getattr(tiers, key) for key in
                               ("host_bytes", "file_bytes", "file_units", "staging_bytes", "budget")}
            result["policy"] = loaded.policy
        loaded_at, cpu_loaded = time.time(), cpu_seconds()
        first_s, logits = forward(model)
        forwarded_at = time.time()
        result.update(load_cpu_s=cpu_loaded - cpu_imported, first_forward_cpu_s=cpu_seconds() - cpu_imported)
        result["checksum"] = [float(logits.double().sum()), float(logits.abs().double().sum())]
        steady_s, _ = forward(model)  # the steady forward: weights in place, the read-ahead order learnt
        result["steady_forward_1tok_s"], _ = forward(model, 1)  # a decode step's: reads, not compute, dominate
        result.update(import_s=imported - spawn, load_s=loaded_at - imported, first_forward_s=forwarded_at - imported,
                      load_from_spawn_s=loaded_at - spawn, first_forward_from_spawn_s=forwarded_at - spawn,
                      first_forward_only_s=first_s, steady_forward_s=steady_s, torch_threads=torch.get_num_threads())
        if mode == "streamwise-half" and args.cold:  # the disk's steady forward: the file tier's bytes evicted
            evict(folder)
            result["cached_before_cold_forward"] = cached_bytes(folder)
            result["cold_steady_forward_s"], _ = forward(model)
            evict(folder)
            result["cold_steady_forward_1tok_s"], _ = forward(model, 1)
    peak = sampler.stop()
    result.update(baseline=base, peak=peak, samples=sampler.samples, vmhwm=status()["VmHWM"],
                  peak_anon_above_baseline=peak["RssAnon"] - base["RssAnon"],
                  peak_rss_above_baseline=peak["VmRSS"] - base["VmRSS"])
    print(MARK + json.dumps(result), flush=True)


def raw_copy(files: list[Path]) -> int:
    """Read every file into fresh anonymous memory (kept until the end, as a load keeps it), `BUFFER`-byte chunks
    over min(READERS, CPUs) threads; the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    copies, chunks = [], []
    for path in files:
        size = path.stat().st_size
        # private and untouched, as a load's buffers are: every page is faulted in by the read
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        copies.append(memory)
        chunks += [(path, memory, start, min(BUFFER, size - start)) for start in range(0, size, BUFFER)]

    def read(chunk) -> int:
        path, memory, start, count = chunk
        view, done = memoryview(memory)[start:start + count], 0
        with open(path, "rb", buffering=0) as handle:
            while done < count:
                done += os.preadv(handle.fileno(), [view[done:]], start + done)
        return done

    with ThreadPoolExecutor(min(READERS, os.cpu_count() or 1)) as pool:
        return sum(pool.map(read, chunks))


# --- the parent: rounds ------------------------------------------------------------------------------------------


def run_child(mode: str, folder: Path, extra: dict, *, cold: bool, preexec=None, timeout: float = 1800) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--folder", str(folder),
               "--cold", str(int(cold))]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    command += ["--spawn-time", repr(time.time())]
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    process = subprocess.run(command, capture_output=True, text=True, preexec_fn=preexec, timeout=timeout, env=env)
    found = [line for line in process.stdout.splitlines() if line.startswith(MARK)]
    out = json.loads(found[-1][len(MARK):]) if found else {"mode": mode}
    out["returncode"] = process.returncode
    if process.returncode != 0 or not found:
        lines = [line for line in (process.stdout + process.stderr).splitlines() if line.strip()]
        out["output_tail"] = lines[-6:]
        out["message"] = lines[-1] if lines else "(nothing printed)"
    return out


def prepare(folder: Path, state: str) -> int | None:
    if state == "cold":
        evict(folder)
    else:
        warm(folder)
    return cached_bytes(folder)


def stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


METRICS = (  # key in a child's result, column, scale
    ("import_s", "imports s", 1),
    ("load_from_spawn_s", "load s (spawn)", 1),
    ("load_s", "load s (after imports)", 1),
    ("first_forward_from_spawn_s", "1st fwd s (spawn)", 1),
    ("first_forward_s", "1st fwd s (after imports)", 1),
    ("first_forward_only_s", "1st fwd alone s", 1),
    ("load_cpu_s", "load CPU s", 1),
    ("first_forward_cpu_s", "load + 1st fwd CPU s", 1),
    ("steady_forward_s", "steady fwd s", 1),
    ("cold_steady_forward_s", "cold steady fwd s", 1),
    ("steady_forward_1tok_s", "steady 1-token fwd s", 1),
    ("cold_steady_forward_1tok_s", "cold steady 1-token fwd s", 1),
    ("read_s", "read s", 1),
    ("read_cpu_s", "read CPU s", 1),
    ("read_GBps", "read GB/s", 1),
    ("peak_anon_above_baseline", "peak anon +MiB", 2**-20),
    ("peak_file", "peak file MiB", 2**-20),
    ("vmhwm", "VmHWM MiB", 2**-20),
)


def metric(result: dict, key: str) -> float | None:
    if key == "peak_file":
        return result.get("peak", {}).get("RssFile")
    return result.get(key)


def summarize(runs: list[dict]) -> dict:
    summary: dict = {}
    for state in ("warm", "cold"):
        for mode in MODES:
            chosen = [r for r in runs if r["mode"] == mode and r["state"] == state and r["returncode"] == 0]
            if chosen:
                summary[f"{mode}/{state}"] = {key: stats([metric(r, key) for r in chosen]) for key, _, _ in METRICS}
    return summary


def cell(entry: dict | None, scale: float) -> str:
    if entry is None:
        return "-"
    fmt = (lambda v: f"{v * scale:.0f}") if scale != 1 else (lambda v: f"{v:.3f}" if v < 10 else f"{v:.2f}")
    return f"{fmt(entry['median'])} [{fmt(entry['min'])}-{fmt(entry['max'])}]"


def table(summary: dict) -> str:
    columns = [(key, name, scale) for key, name, scale in METRICS
               if any(values.get(key) for values in summary.values())]
    lines = ["| mode / cache | " + " | ".join(name for _, name, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for row, values in summary.items():
        lines.append(f"| {row} | " + " | ".join(cell(values.get(key), scale) for key, _, scale in columns) + " |")
    return "\n".join(lines)


def goals(summary: dict, runs: list[dict], largest: int) -> list[dict]:
    verdicts = []

    def median(row: str, key: str) -> float | None:
        entry = summary.get(row, {}).get(key)
        return entry["median"] if entry else None

    def verdict(name: str, value: float | None, goal: float, detail: str) -> None:
        ok = None if value is None else value <= goal
        verdicts.append({"goal": name, "value": value, "limit": goal, "detail": detail,
                         "verdict": "n/a" if ok is None else "PASS" if ok else "FAIL"})

    for mode, host_tier in (("streamwise", "leased"), ("streamwise-copied", "copied")):
        for state in ("warm", "cold"):
            for key, what in (("first_forward_from_spawn_s", "from spawn"), ("first_forward_s", "after imports")):
                ours, theirs = median(f"{mode}/{state}", key), median(f"transformers/{state}", key)
                ratio = ours / theirs if ours and theirs else None
                copy, load = median(f"raw-copy/{state}", "read_s"), median(f"{mode}/{state}", "load_s")
                verdict(f"first forward {state} ({what}), host tier {host_tier} / transformers", ratio,
                        FIRST_FORWARD_GOAL,
                        f"{mode} {ours and round(ours, 3)} s vs transformers {theirs and round(theirs, 3)} s (load "
                        f"after imports {load and round(load, 3)} s; a private copy of the checkpoint takes at least "
                        f"{copy and round(copy, 3)} s)")
    for state, key, what in (("warm", "steady_forward_s", ""), ("cold", "cold_steady_forward_s", ""),
                             ("warm", "steady_forward_1tok_s", " (1 token)"),
                             ("cold", "cold_steady_forward_1tok_s", " (1 token)")):
        ours, raw = median(f"streamwise-half/{state}", key), median(f"raw-read-half/{state}", "read_s")
        resident = median(f"streamwise/{state}", key.removeprefix("cold_"))
        ratio = ours / raw if ours and raw else None
        verdict(f"file-tier forward{what} {state} / raw read of its bytes", ratio, FILE_TIER_GOAL,
                f"forward {ours and round(ours, 3)} s vs raw read {raw and round(raw, 3)} s (all weights in "
                f"memory: {resident and round(resident, 3)} s)")
        best = max(raw, resident) if raw and resident else None  # reads and compute perfectly overlapped
        verdict(f"file-tier forward{what} {state} / max(raw read, the forward with every weight in memory)",
                ours / best if ours and best else None, FILE_TIER_GOAL,
                f"where compute takes longer than 1.5x the read, no overlap meets the line above; this one says "
                f"how close the reads come to hiding behind compute (best {best and round(best, 3)} s)")
    for mode in ("streamwise-half", "streamwise", "streamwise-copied"):
        chosen = [r for r in runs if r["mode"] == mode and r["returncode"] == 0 and r.get("tiers")]
        if not chosen:
            continue
        worst = max(chosen, key=lambda r: r["peak_anon_above_baseline"])
        budget = worst["tiers"]["budget"]
        allowed = (budget + largest) * (1 + ANON_SLACK)
        verdict(f"{mode}: peak anon above baseline / (budget + largest unit) x 1.1 (worst round)",
                worst["peak_anon_above_baseline"] / allowed, 1.0,
                f"{worst['peak_anon_above_baseline'] / 2**20:.0f} MiB vs budget {budget / 2**20:.0f} MiB + largest "
                f"unit {largest / 2**20:.0f} MiB (+10%: {allowed / 2**20:.0f} MiB)")
    return verdicts


def agree(runs: list[dict]) -> dict:
    """Whether every loader computed the same logits (sums within float32 summation noise)."""
    sums = {(r["mode"], r["state"], r.get("round"), r.get("fraction")): r["checksum"]
            for r in runs if r.get("checksum")}
    if not sums:
        return {"agree": None}
    reference = next(iter(sums.values()))
    worst = max(abs(value[1] - reference[1]) / max(abs(reference[1]), 1e-30) for value in sums.values())
    return {"agree": worst < 1e-4, "worst_relative_difference_of_abs_sum": worst, "reference": reference}


# --- cgroups -----------------------------------------------------------------------------------------------------


def memory_cgroup() -> tuple[str, Path] | None:
    """("v1" | "v2", this process's own memory cgroup folder), where a child cgroup can be made under it."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (folder / "memory.limit_in_bytes").exists():
                return "v1", folder
        if number == "0" and controllers == "":
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (folder / "cgroup.controllers").exists() and "memory" in (folder / "cgroup.controllers").read_text():
                return "v2", folder
    return None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def under_limit(mode: str, folder: Path, extra: dict, limit: int, state: str) -> dict:
    found = memory_cgroup()
    if found is None:
        return {"mode": mode, "error": "no memory cgroup to make a child cgroup under"}
    version, parent = found
    group = parent / f"swbench-{os.getpid()}-{mode}-{limit}"
    group.mkdir()
    try:
        (group / ("memory.limit_in_bytes" if version == "v1" else "memory.max")).write_text(str(limit))
        if version == "v2":
            (group / "memory.swap.max").write_text("0") if (group / "memory.swap.max").exists() else None
        procs = str(group / "cgroup.procs")

        def enter() -> None:  # in the child, before exec: the whole process runs under the limit
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))

        prepare(folder, state)
        out = run_child(mode, folder, extra, cold=state == "cold", preexec=enter)
        if version == "v1":
            out["cgroup"] = {name: read_text(group / f"memory.{name}") for name in
                             ("max_usage_in_bytes", "failcnt")}
            out["cgroup"]["oom_control"] = read_text(group / "memory.oom_control")
        else:
            out["cgroup"] = {name: read_text(group / f"memory.{name}") for name in ("peak", "events")}
        return out
    finally:
        remove_cgroup(group)


def remove_cgroup(group: Path) -> None:
    """Remove a trial's cgroup once the kernel has let its last process go (it may take a moment)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


# --- main --------------------------------------------------------------------------------------------------------


def byte_compile_package() -> None:
    """Compile Streamwise's modules as `pip install` does: transformers' came compiled, and an editable checkout under
    PYTHONDONTWRITEBYTECODE (this VM sets it) would otherwise compile Streamwise's source in every fresh process
    (0.12 s of each load, measured)."""
    import compileall

    for folder in ("runtime", "schemas", "comfy_nodes"):
        compileall.compile_dir(REPO / folder, quiet=1)
    compileall.compile_file(REPO / "__init__.py", quiet=1)


def versions() -> dict:
    out = subprocess.run([sys.executable, "-c", "import torch, transformers, safetensors; print(torch.__version__, "
                          "transformers.__version__, safetensors.__version__)"], capture_output=True, text=True)
    torch_version, transformers_version, safetensors_version = out.stdout.split()
    return {"torch": torch_version, "transformers": transformers_version, "safetensors": safetensors_version,
            "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="the checkpoint's size at least, in GiB")
    parser.add_argument("--quick", action="store_true", help="a ~200 MB model, for a smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in the children; 0: torch's default (every core)")
    parser.add_argument("--workdir", default="/tmp/streamwise-bench-tiers")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--states", default="warm,cold")
    parser.add_argument("--cgroup-limit", metavar="FRACTIONS",
                        help="also run each loader under a memory cgroup of these multiples of the checkpoint")
    parser.add_argument("--cgroup-states", default="cold", help="cache states of the cgroup runs")
    parser.add_argument("--no-timing", action="store_true", help="the cgroup runs only")
    parser.add_argument("--out", help="results base path (.json and .md appended)")
    # a child's arguments
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--cold", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--spawn-time", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--file-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    started = datetime.datetime.now().astimezone()
    load_start = os.getloadavg()
    byte_compile_package()
    config = model_config(0.2 if args.quick and args.size_gb == 2.0 else args.size_gb, args.quick)
    workdir = Path(args.workdir)
    if args.out:
        base = Path(args.out)
    elif args.quick:
        base = workdir / f"memory_tiers-quick-{started:%Y-%m-%d}"
    else:
        base = RESULTS / f"memory_tiers{'-cgroup' if args.no_timing else ''}-{started:%Y-%m-%d}"
    base.parent.mkdir(parents=True, exist_ok=True)
    folder = ensure_model(workdir, config)
    total, largest = header_units(folder)
    size = sum(path.stat().st_size for path in weight_files(folder))
    print(f"checkpoint {size / 2**30:.3f} GiB ({size / 1e9:.2f} GB) in {len(weight_files(folder))} file(s), "
          f"{config['num_hidden_layers']} layers, largest unit {largest / 2**20:.0f} MiB", flush=True)

    # the half budget: half the checkpoint in memory, plus the staging buffers the file tier needs
    for _attempt in range(5):  # others edit the tree meanwhile: an import can fail for a moment
        probe = subprocess.run([sys.executable, "-c", "from streamwise.runtime.engine.file_reads import FileTier; "
                                "print(FileTier.SLABS)"], capture_output=True, text=True)
        if probe.returncode == 0:
            break
        print(f"importing streamwise failed, retrying: {probe.stderr.strip().splitlines()[-1:]}", flush=True)
        time.sleep(10)
    slabs = int(probe.stdout.split()[-1])
    budget = total // 2 + slabs * largest
    extra = {"tokens": args.tokens, "vocab": config["vocab_size"], "budget": budget, "threads": args.threads}
    first = run_child("streamwise-half", folder, extra, cold=False)
    if first["returncode"] != 0:
        sys.exit(f"the half-budget load failed: {first.get('output_tail')}")
    extra["file_bytes"] = first["tiers"]["file_bytes"]
    print(f"half budget {budget / 2**20:.0f} MiB ({slabs} staging slabs): {first['tiers']}", flush=True)

    header = {
        "date": started.isoformat(timespec="seconds"), "commit": git_commit(), **versions(), "machine": machine(),
        "model": {"class": "Qwen2ForCausalLM", "dtype": "float32", **config, "checkpoint_bytes": size,
                  "tensor_bytes": total, "largest_unit_bytes": largest, "folder": str(folder)},
        "rounds": args.rounds, "tokens": args.tokens, "torch_threads": args.threads or "default",
        "half_budget": budget, "staging_slabs": slabs,
        "half_file_bytes": extra["file_bytes"], "loadavg_start": load_start,
    }
    runs: list[dict] = []
    limits: list[dict] = []

    def save_so_far() -> None:  # the raw results after every child: a late failure loses nothing
        Path(f"{base}.json").write_text(json.dumps({**header, "runs": runs, "cgroup_runs": limits}, indent=1) + "\n")

    modes = [mode for mode in args.modes.split(",") if mode]
    states = [state for state in args.states.split(",") if state]
    if not args.no_timing:
        for index in range(args.rounds):
            for state in states:
                for mode in modes if index % 2 == 0 else modes[::-1]:  # no mode always right after another
                    cached = prepare(folder, state)
                    out = run_child(mode, folder, extra, cold=state == "cold")
                    out.update(state=state, round=index + 1, cached_before=cached, loadavg=os.getloadavg())
                    runs.append(out)
                    save_so_far()
                    shown = {key: round(out[key], 3) for key in ("load_from_spawn_s", "first_forward_from_spawn_s",
                             "steady_forward_s", "cold_steady_forward_s", "read_s") if out.get(key) is not None}
                    anon = out.get("peak_anon_above_baseline")
                    print(f"round {index + 1} {state:4s} {mode:16s} rc={out['returncode']} cached={cached} {shown} "
                          f"anon+={anon and anon >> 20} MiB {out.get('output_tail', '')}", flush=True)
    if args.cgroup_limit:
        for fraction in (float(word) for word in args.cgroup_limit.split(",")):
            for state in args.cgroup_states.split(","):
                for mode in LOAD_MODES:
                    limit = int(fraction * size)
                    out = under_limit(mode, folder, extra, limit, state)
                    out.update(fraction=fraction, limit=limit, state=state)
                    limits.append(out)
                    save_so_far()
                    print(f"cgroup {fraction}x ({limit / 2**20:.0f} MiB) {state} {mode}: rc={out.get('returncode')} "
                          f"{out.get('tiers', '')} {out.get('output_tail', '')} {out.get('cgroup', '')}", flush=True)

    summary = summarize(runs)
    verdicts = goals(summary, runs, largest) if runs else []
    same = agree(runs + limits)
    header["loadavg_end"] = os.getloadavg()
    results = {**header, "summary": summary, "goals": verdicts, "logits": same, "runs": runs, "cgroup_runs": limits}

    lines = [f"# Memory tiers (#33): `python benchmarks/bench_memory_tiers.py {' '.join(sys.argv[1:])}`", "",
             f"- date {header['date']}, commit {header['commit']}",
             f"- torch {header['torch']}, transformers {header['transformers']}, safetensors "
             f"{header['safetensors']}, Python {header['python']}",
             f"- machine: {header['machine'].get('cpus')} CPUs ({header['machine'].get('cpu')}), "
             f"{header['machine'].get('MemTotal', 0) / 2**30:.1f} GiB RAM, kernel {header['machine']['kernel']}; "
             f"load average {tuple(round(v, 2) for v in load_start)} at start, "
             f"{tuple(round(v, 2) for v in header['loadavg_end'])} at end",
             f"- model: Qwen2ForCausalLM float32, {config['num_hidden_layers']} layers, hidden "
             f"{config['hidden_size']}, checkpoint {size / 2**30:.3f} GiB ({size / 1e9:.2f} GB), largest unit "
             f"{largest / 2**20:.0f} MiB; "
             f"{args.tokens} tokens; torch threads {args.threads or 'default'}; {args.rounds} rounds interleaved, "
             "fresh process each",
             f"- half budget: max_memory cpu {budget / 2**20:.0f} MiB (half the checkpoint + {slabs} x the largest "
             f"unit of staging) -> {extra['file_bytes'] / 2**20:.0f} MiB on the file tier",
             f"- logits agree across loaders: {same.get('agree')}", ""]
    if runs:
        lines += ["Median [min-max]; times from the child's spawn unless noted; peak anon = peak RssAnon above the "
                  "import baseline.", "", table(summary), "", "| goal | value | limit | verdict | detail |",
                  "|---|---|---|---|---|"]
        for v in verdicts:
            value = "-" if v["value"] is None else f"{v['value']:.2f}"
            lines.append(f"| {v['goal']} | {value} | {v['limit']} | {v['verdict']} | {v['detail']} |")
    if limits:
        lines += ["", "Under a memory cgroup (limit = a multiple of the checkpoint; rc -9 = killed by the OOM killer):",
                  "",
                  "| limit | cache | loader | rc | file tier | load s | 1st fwd s | steady fwd s | peak anon +MiB | "
                  "cgroup max usage MiB | message |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for out in limits:
            tiers = out.get("tiers")
            tier = f"{tiers['file_bytes'] / 2**20:.0f} MiB in file, budget {tiers['budget'] / 2**20:.0f} MiB" \
                if tiers else "-"
            anon = out.get("peak_anon_above_baseline")
            message = out.get("message", "").replace("|", "\\|")
            usage = (out.get("cgroup") or {}).get("max_usage_in_bytes") or (out.get("cgroup") or {}).get("peak")
            times = " | ".join(f"{out[key]:.2f}" if out.get(key) is not None else "-"
                               for key in ("load_s", "first_forward_s", "steady_forward_s"))
            lines.append(f"| {out['fraction']}x ({out['limit'] / 2**20:.0f} MiB) | {out['state']} | {out['mode']} | "
                         f"{out.get('returncode')} | {tier} | {times} | {anon and anon >> 20} | "
                         f"{int(usage) >> 20 if usage else '-'} | {message or '-'} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)

    Path(f"{base}.json").write_text(json.dumps(results, indent=1) + "\n")
    Path(f"{base}.md").write_text(text)
    print(f"wrote {base}.json and {base}.md")


if __name__ == "__main__":
    main()
