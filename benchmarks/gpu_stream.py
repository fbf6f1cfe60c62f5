"""Each streaming configuration against its physical floor on a GPU: T >= max(T_compute, W / B_h2d, W_file / B_file).

A Qwen2-style decoder (bf16) runs resident (T_compute, the same weights and mode) and placed with three quarters of
its weights streamed; W is the bytes streamed per forward, B_h2d one pinned copy of W bytes timed in the same run,
W_file the bytes read from the file tier per forward and B_file the file read by as many threads as the tier's
readers into pinned memory (warm page cache). Configurations (`CONFIGURATIONS`, in priority order, each written to
`--out` as soon as it is measured: a cut-off run keeps what it measured): weights bf16 (blocks as units; `-leaves`:
every streamed leaf its own unit), INT8, and GGUF Q8_0 and Q4_K written from the same decoder by Streamwise's
writer; eager or compiled; host memory or half of the streamed bytes left in the file; placed by `offload` (its
streamed blocks spread along their bytes; `measured`: along the compute of a measuring forward, `measure=`) or by
`dispatch` (accelerate's hooks, the `"cpu"` entry streamed). Each records the forward time, the floor and the ratio
(goal <= 1.15), peak device bytes, how much the process's anonymous memory grew while placing (beside the host tier's
bytes: packing it holds one piece more at most), whether the logits equal the resident run's (and by how much they
differ), the engine's own timing of its first forward (`engine.stream.measure`), and whether one forward runs
under `torch.cuda.set_sync_debug_mode("error")` (no call that waits on the host). Last (`decode`), the same decoder
generating token by token with the streamed part computed on the host where its costs say so (`host_compute=True`),
beside the same part streamed: ms per token, the blocks that may compute on the host, the measured costs, and
whether both decode the same tokens (the host's kernels round differently from the GPU's). Before it
(`decode-q8_0`, `decode-q4_k`), the GGUF decoder streamed whole decoding token by token (a GGUF layer called with a
few rows multiplies its blocks directly, `gguf_triton.matmul`): ms per token against the link's time for its
quantized bytes (goal <= 1.15x), its tokens against the same file resident. After the configurations (`rewrite`),
the decoder's file overwritten under it: streamed from host memory the same tokens after, from the file tier the
reader's `CheckpointError`. Under ComfyUI core: `gpu_comfy.py`.

    python benchmarks/gpu_stream.py [--quick] [--layers 16] [--hidden 2048] [--tokens 128] [--out FILE]
    python benchmarks/gpu_stream.py --decode-only --layers 8 --hidden 4096 --intermediate 14336  # issue 56's decode
    python benchmarks/gpu_stream.py --dry-run      # on a CPU: the recording fake device, a tiny model, end to end

`--quick` runs the first `QUICK` configurations (on a GPU at 8 layers at most: minutes). Fixtures are made on the
spot (no network)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from bench_memory_tiers import Sampler  # this folder's: peaks of the process's memory, sampled
from gpu_check import decoder, decoder_options, timed  # this folder's: the GPU benchmarks' model, timed alike
from leases import lease_folder, rewrite  # this folder's: a writer changing the file under a loaded model
from report import emit, section  # this folder's: every GPU benchmark hands over its figures alike

import streamwise
from streamwise.runtime.checkpoint.errors import CheckpointError
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
from streamwise.runtime.convert import applied_state
from streamwise.runtime.engine.file_reads import FileTier
from streamwise.runtime.engine.stream.on_host import StreamCosts
from streamwise.runtime.hosts import dispatch, standalone

REPO = Path(__file__).resolve().parent.parent
CONFIGURATIONS = (  # (weights, mode, tier, host) in priority order; `--quick` runs the first QUICK
    ("bf16", "eager", "host", "standalone"), ("bf16", "eager", "host", "measured"),
    ("q8_0", "eager", "host", "standalone"), ("int8", "eager", "host", "standalone"),
    ("bf16", "compiled", "host", "standalone"),
    ("q8_0", "compiled", "host", "standalone"), ("q4_k", "eager", "host", "standalone"),
    ("int8", "compiled", "host", "standalone"), ("bf16", "eager", "file", "standalone"),
    ("q8_0", "eager", "file", "standalone"), ("bf16-leaves", "eager", "host", "standalone"),
    ("bf16", "eager", "host", "dispatch"), ("q8_0", "eager", "host", "dispatch"),
)
QUICK = 4
STREAMED_SHARE = 0.75
GGUF = {"q8_0": "Q8_0", "q4_k": "Q4_K"}
"""The GGUF weights: the decoder written by Streamwise's writer in that type, every Linear a resident."""


def policy(weights: str, mode: str):
    chosen = streamwise.load_policy("decoder-llm")
    quant = {"int8": {"id": "q", "format": "int8", "select": {"class": "Linear"}},
             **{name: {"id": "q", "format": "gguf", "gguf_type": kind, "select": {"class": "Linear"}}
                for name, kind in GGUF.items()}}.get(weights)
    if quant is not None:
        chosen = chosen.model_copy(update={"quant": type(chosen.quant).model_validate({"rule": [quant]})})
    if weights.endswith("-leaves"):  # no blocks: every streamed leaf its own unit, as before the engine
        chosen = chosen.model_copy(update={"compile": chosen.compile.model_copy(update={"blocks": None})})
    if mode == "compiled":
        chosen = chosen.model_copy(update={"compile": chosen.compile.model_copy(update={"enabled": True})})
    return chosen


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_seconds(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """One copy of `nbytes` from pinned host memory to `device`, timed (the best of `repeats`)."""
    source = torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        source.to(device, non_blocking=True)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def file_seconds(path: Path, nbytes: int, device: torch.device) -> float:
    """`nbytes` of `path` read into host memory (pinned where the device is CUDA) by the file tier's reader threads,
    warm page cache, timed (the best of three)."""
    readers = FileTier.READERS
    target = torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda").numpy()
    share = -(-nbytes // readers)
    best = float("inf")
    with open(path, "rb") as handle, ThreadPoolExecutor(readers) as pool:
        for _ in range(3):  # the file's first `nbytes` (no more than the file tier's share of it), a range a thread
            start = time.perf_counter()
            list(pool.map(lambda i: os.preadv(handle.fileno(), [target[i * share:(i + 1) * share]], i * share),
                          range(readers)))
            best = min(best, time.perf_counter() - start)
    return best


def configuration(weights: str, mode: str, tier: str, host_kind: str, host: torch.nn.Module, ids: torch.Tensor,
                  repeats: int, folder: Path) -> dict:
    device = ids.device
    chosen = policy(weights, mode)
    source = gguf_file(weights, folder, host) if weights in GGUF else folder / "model.safetensors"

    def fresh(max_memory=None) -> torch.nn.Module:
        if tier == "file" or weights in GGUF:  # the resident run loads the same file (a load keeps rotary tables
            return streamwise.load_pretrained(source, chosen, progress=False, max_memory=max_memory)[0]  # float32)
        return copy.deepcopy(host)

    resident = fresh()
    streamwise.offload(resident, chosen, device=device, budget=None)
    expected, compute = timed(resident, ids, repeats)
    total = sum(p.nbytes for p in resident.parameters())
    del resident
    model = fresh({"cpu": int(total * (1 - STREAMED_SHARE / 2))} if tier == "file" else None)  # half in the file
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    budget = int(total * (1 - STREAMED_SHARE))
    sampler = Sampler()
    before, _ = sampler.peak["RssAnon"], sampler.start()
    if host_kind == "dispatch":
        room = {"cpu": 2 * total}  # the rest in host memory, whatever dispatch counts beside the weights
        placed = streamwise.dispatch(model, chosen, max_memory={device.index or 0: budget, **room}
                                     if device.type == "cuda" else room)
        report, streamed, in_file, pinned = str(placed), placed.bytes.get("cpu", 0), 0, None
    else:
        placed = streamwise.offload(model, chosen, device=device, budget=budget,
                                    measure=(lambda m: m(ids)) if host_kind == "measured" else None)
        report, streamed, in_file, pinned = str(placed), placed.streamed_bytes, placed.file_bytes, placed.pinned_bytes
    placing_grew = sampler.stop()["RssAnon"] - before
    logits, seconds = timed(model, ids, repeats)
    first = getattr(applied_state(model).tree.fetcher, "measured", None)  # the engine's own view of its forward
    link = link_seconds(streamed, device)
    read = file_seconds(source, in_file, device) if in_file else 0.0
    floor = max(compute, link, read)
    no_host_wait = None
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                model(ids)
            no_host_wait = True
        except RuntimeError:
            no_host_wait = False
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {
        "ms": seconds * 1e3, "resident_ms": compute * 1e3, "link_ms": link * 1e3, "file_ms": read * 1e3,
        "floor_ms": floor * 1e3, "ratio": seconds / floor, "streamed_bytes": streamed, "file_bytes": in_file,
        "report": report, "identical_to_resident": bool(torch.equal(logits, expected)),
        "max_abs_difference": float((logits.float() - expected.float()).abs().max()),
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "no_host_wait": no_host_wait, "host_tier_bytes": streamed - in_file,
        "placing_anon_grew_bytes": placing_grew, "pinned_bytes": pinned,
        "first_forward": None if first is None else {"compute_ms": first.compute * 1e3, "copies_ms": first.copies * 1e3,
                                                     "waited_ms": first.waited * 1e3, "ratio": first.ratio},
    }


def gguf_file(weights: str, folder: Path, host: torch.nn.Module) -> Path:
    """The decoder saved in `folder` written as GGUF in `weights`' type by Streamwise's writer (once)."""
    path = folder / f"model-{GGUF[weights]}.gguf"
    if not path.exists():
        quantize_to_gguf(folder / "model.safetensors", path, policy(weights, "eager"), host)
    return path


def quantized_decode(weights: str, host: torch.nn.Module, ids: torch.Tensor, steps: int, folder: Path) -> dict:
    """Token-by-token decode of the GGUF decoder streamed whole (budget 0): ms per token against its floor, the
    quantized bytes over the link (B_h2d one pinned copy of them), and the tokens against the same file resident."""
    device, chosen = ids.device, policy(weights, "eager")
    path = gguf_file(weights, folder, host)
    greedy = dict(do_sample=False, pad_token_id=0)

    def tokens_and_seconds(model: torch.nn.Module) -> tuple[torch.Tensor, float]:
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, **greedy)  # warm: the first forwards (measuring, compiling)
            seconds = []
            for count in (1, steps):  # decode alone: the difference of two runs sharing the prompt
                synchronize(device)
                start = time.perf_counter()
                tokens = model.generate(ids, max_new_tokens=count, min_new_tokens=count, **greedy)
                synchronize(device)
                seconds.append(time.perf_counter() - start)
        return tokens, (seconds[1] - seconds[0]) / (steps - 1)

    resident = streamwise.load_pretrained(path, chosen, progress=False)[0]
    streamwise.offload(resident, chosen, device=device, budget=None)
    expected, resident_seconds = tokens_and_seconds(resident)
    del resident
    model = streamwise.load_pretrained(path, chosen, progress=False)[0]
    report = streamwise.offload(model, chosen, device=device, budget=0)
    got, seconds = tokens_and_seconds(model)
    link = link_seconds(report.streamed_bytes, device)
    return {"ms_per_token": seconds * 1e3, "resident_ms_per_token": resident_seconds * 1e3, "link_ms": link * 1e3,
            "ratio_to_link": seconds / link, "streamed_bytes": report.streamed_bytes, "report": str(report),
            "same_tokens_as_resident": bool(torch.equal(got, expected))}


def rewritten(host: torch.nn.Module, ids: torch.Tensor) -> dict:
    """The decoder's file overwritten in place (zeros, as an editor saving over it) under the model streamed from it:
    from the host tier, the tokens after the rewrite are those before (its bytes are the process's own); from the file
    tier, the next read of the changed file is the reader's `CheckpointError`, never other numbers."""
    device, chosen, result = ids.device, policy("bf16", "eager"), {}
    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    total = sum(p.nbytes for p in host.parameters())
    for tier in ("host", "file"):
        with lease_folder() as folder:
            host.save_pretrained(folder)
            max_memory = {"cpu": int(total * (1 - STREAMED_SHARE / 2))} if tier == "file" else None
            model = streamwise.load_pretrained(folder, chosen, progress=False, max_memory=max_memory)[0]
            report = streamwise.offload(model, chosen, device=device, budget=int(total * (1 - STREAMED_SHARE)))
            with torch.inference_mode():
                before = model.generate(ids, **greedy)
            held = rewrite(Path(folder, "model.safetensors"))
            try:
                with torch.inference_mode():
                    after = "the same tokens" if torch.equal(model.generate(ids, **greedy), before) else "OTHER TOKENS"
            except CheckpointError as exc:
                after = f"CheckpointError: {str(exc)[:200]}"
            result[tier] = {"file_bytes": report.file_bytes, "writer_held_s": held, "after_the_rewrite": after}
            del model
    return result


def decode(host: torch.nn.Module, ids: torch.Tensor, steps: int) -> dict:
    """ms per decoded token with the streamed part computed on the host where cheaper, and with it streamed."""
    device, figures, tokens = ids.device, {}, {}
    for name, on_host in (("streamed", False), ("on_host", True)):
        model = copy.deepcopy(host)
        total = sum(p.nbytes for p in model.parameters())
        costs = StreamCosts() if on_host else False
        report = streamwise.offload(model, policy("bf16", "eager"), device=device,
                                    budget=int(total * (1 - STREAMED_SHARE)), host_compute=costs)
        greedy = dict(do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, **greedy)  # the measuring forwards: the prompt's size, one row
            synchronize(device)
            start = time.perf_counter()
            tokens[name] = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **greedy)
            synchronize(device)
        prompt = time.perf_counter() - start
        figures[name] = {"ms_per_token_with_prompt": prompt * 1e3 / steps, "host_blocks": report.host_blocks,
                         "report": str(report)}
        if on_host:
            figures[name]["link_s_per_MiB"] = costs.link * 2**20
            figures[name]["host_s_per_MiB"] = {rows: cost * 2**20 for rows, cost in costs.host.items()}
        del model
    figures["same_tokens"] = bool(torch.equal(tokens["streamed"], tokens["on_host"]))
    return figures


def main() -> None:
    parser = decoder_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--decode-only", action="store_true", help="the GGUF decode sections alone (issue 56's run: "
                        "--layers 8 --hidden 4096 --intermediate 14336)")
    parser.add_argument("--dry-run", action="store_true", help="a CPU, the recording fake device, a tiny model")
    args = parser.parse_args()
    if args.dry_run:
        sys.path.insert(0, str(REPO / "tests"))
        from recording_device import RecordingOps

        standalone.device_ops = dispatch.device_ops = lambda device: RecordingOps()
        device, layers, hidden, repeats = torch.device("cpu"), 2, 256, 1
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run with --dry-run on a CPU")
        device, layers, hidden, repeats = torch.device("cuda"), args.layers, args.hidden, args.repeats
        layers = min(layers, 8) if args.quick else layers
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
                     "torch": torch.__version__, "cuda": torch.version.cuda,
                     "model": {"layers": layers, "hidden": hidden, "intermediate": args.intermediate,
                               "tokens": args.tokens}}
    host = decoder(layers, hidden, torch.bfloat16, None if args.dry_run else args.intermediate)
    ids = torch.randint(0, 32000, (1, args.tokens), device=device)
    with tempfile.TemporaryDirectory() as folder:
        host.save_pretrained(folder)  # the file tier's and the GGUF files' source
        chosen = () if args.decode_only else CONFIGURATIONS[:QUICK] if args.quick else CONFIGURATIONS
        for weights, mode, tier, host_kind in chosen:
            section(results, f"{weights}-{mode}-{tier}-{host_kind}", configuration, weights, mode, tier, host_kind,
                    host, ids, repeats, Path(folder))
            emit(results, args.out)  # after each: a run cut off keeps what it measured
        if not args.decode_only:
            section(results, "rewrite", rewritten, host, ids[:, :16])
            emit(results, args.out)
        steps = 4 if args.dry_run else 64
        for weights in () if args.quick else GGUF:  # decode at the link's speed: the quantized bytes, no expansion
            section(results, f"decode-{weights}", quantized_decode, weights, host, ids[:, :16], steps, Path(folder))
            emit(results, args.out)
    if not args.decode_only:
        section(results, "decode", decode, host, ids[:, :16], 4 if args.dry_run else 32)
        emit(results, args.out)


if __name__ == "__main__":
    main()
