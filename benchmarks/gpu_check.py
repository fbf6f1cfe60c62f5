"""What only a GPU can show: real streaming from pinned host memory, copies ahead (the streaming engine),
relocated tensors following CUDA, two trees on two devices in one process, and the three tiers.

A Qwen2-style decoder in bf16 runs (1) fully resident on the GPU, (2) under the standalone host
with a quarter of its weights resident and the rest streamed, with and without prefetch. Outputs
must be bit-identical to the resident run. (3) The same decoder saved with `save_pretrained` and
loaded under a host budget that leaves half its blocks in the file: streamed onto the GPU, its
logits equal the resident run's, and its host tier is pinned in pieces whose sizes torch's pinned allocator takes
without rounding (powers of two), the allocator's own figure beside them. (4) Loaded whole
with its host tier leased (viewing the page cache), placed on the GPU, then its file overwritten with zeros: the
writer waits for the copy, and the logits stay the resident run's.
Run on a CUDA machine:

    python benchmarks/gpu_check.py [--layers 16] [--hidden 2048] [--tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers
from leases import file_system, lease_folder, rewrite, viewing_file  # this folder's, as report's
from report import emit, section  # this folder's: every GPU benchmark hands over its figures alike

import streamwise
from streamwise.runtime.engine.relocating import offload_relocated


def decoder(layers: int, hidden: int, dtype: torch.dtype, intermediate: int | None = None) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        hidden_size=hidden, intermediate_size=intermediate or hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), vocab_size=32000,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to(dtype).eval()


def timed(model, ids, repeats: int) -> tuple[torch.Tensor, float]:
    cuda = ids.device.type == "cuda"
    with torch.inference_mode():
        for _ in range(2):
            logits = model(ids).logits
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            logits = model(ids).logits
        if cuda:
            torch.cuda.synchronize()
    return logits, (time.perf_counter() - start) / repeats


def decoder_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of a run of `decoder` (the GPU benchmarks' model), and `--out`."""
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, help="the MLP's width (default: 11/4 of --hidden)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out")
    return parser


def main() -> None:
    args = decoder_options(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }

    host = decoder(args.layers, args.hidden, dtype)
    total = sum(p.numel() * p.element_size() for p in host.parameters())
    ids = torch.randint(0, 32000, (1, args.tokens), device=device)
    resident = copy.deepcopy(host).to(device)
    expected, resident_time = timed(resident, ids, args.repeats)
    del resident
    results["model"] = {"layers": args.layers, "hidden": args.hidden, "weights_bytes": total, "tokens": args.tokens}
    results["resident_ms"] = resident_time * 1e3

    budget = total // 4
    for prefetch in (True, False):
        model = copy.deepcopy(host)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        report = streamwise.offload(model, "decoder-llm", device=device, budget=budget, prefetch=prefetch)
        logits, seconds = timed(model, ids, args.repeats)
        key = "streamed_prefetch" if prefetch else "streamed_no_prefetch"
        results[key] = {
            "ms": seconds * 1e3,
            "identical_to_resident": bool(torch.equal(logits, expected)),
            "resident_bytes": report.resident_bytes,
            "streamed_bytes": report.streamed_bytes,
            "host_to_device_GBps": report.streamed_bytes / seconds / 1e9,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "weights_pinned": all(
                p.is_pinned()
                for m in model.modules() if getattr(m, "comfy_cast_weights", False)
                for p in m.parameters(recurse=False)
            ) if device.type == "cuda" else None,
        }
        rotary = model.model.rotary_emb
        results[key]["inv_freq_follows"] = rotary.inv_freq.device.type
        offload_relocated(model, torch.device("cpu"))
        results[key]["inv_freq_after_unload"] = rotary._buffers["inv_freq"].device.type
        del model

    small_gpu, small_cpu = decoder(2, 256, torch.float32), decoder(2, 256, torch.float32)
    small_cpu.load_state_dict(small_gpu.state_dict())
    tokens = torch.randint(0, 32000, (1, 16))
    with torch.inference_mode():
        reference = small_cpu(tokens).logits
    streamwise.offload(small_gpu, "decoder-llm", device=device, budget=0)
    streamwise.offload(small_cpu, "decoder-llm", device="cpu", budget=0)
    with torch.inference_mode():
        outputs = [
            small_gpu(tokens.to(device)).logits.cpu(),
            small_cpu(tokens).logits,
            small_gpu(tokens.to(device)).logits.cpu(),
        ]
    results["two_trees"] = {
        "cpu_tree_identical": bool(torch.equal(outputs[1], reference)),
        "gpu_tree_close": bool(
            torch.allclose(outputs[0], reference, atol=1e-4) and torch.equal(outputs[0], outputs[2])
        ),
        "gpu_tree_inv_freq": small_gpu.model.rotary_emb.inv_freq.device.type,
        "cpu_tree_inv_freq": small_cpu.model.rotary_emb.inv_freq.device.type,
    }
    tied = decoder(2, 256, torch.float32)
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    tied_reference = copy.deepcopy(tied)
    streamwise.offload(tied, "decoder-llm", device=device, budget=0)
    with torch.inference_mode():
        results["tied_weights_streamed"] = bool(torch.allclose(
            tied(tokens.to(device)).logits.cpu(), tied_reference(tokens).logits, atol=1e-4))
        tied(tokens.to(device))  # a second pass: prefetched copies are waiting for the next forward
        tied.model.norm.weight.zero_()  # an in-place update between forwards
        tied.model.layers[0].mlp.down_proj.weight.zero_()
        tied_reference.model.norm.weight.zero_()
        tied_reference.model.layers[0].mlp.down_proj.weight.zero_()
        results["in_place_update_seen_after_prefetch"] = bool(torch.allclose(
            tied(tokens.to(device)).logits.cpu(), tied_reference(tokens).logits, atol=1e-4))
    section(results, "three_tiers", three_tiers, host, ids, device)
    section(results, "leased_host_tier", leased_host_tier, host, ids, device)
    emit(results, args.out)


def three_tiers(host: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> dict:
    """Device <- pinned host memory <- file: half the streamed bytes left in the file by the host budget, against
    transformers' own load of the same folder, resident on the device (a model loaded in bf16 keeps its rotary
    frequencies in float32, where `host`, cast after it was built, holds them in bf16)."""
    from streamwise.runtime.engine import file_tier

    with lease_folder() as folder:
        host.save_pretrained(folder)
        reference = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=host.dtype).eval().to(device)
        expected, resident_seconds = timed(reference, ids, 3)
        del reference
        total = sum(p.nbytes for p in host.parameters())
        loaded = streamwise.load_pretrained(folder, "decoder-llm", progress=False, max_memory={"cpu": total // 2})
        model = loaded.model
        report = streamwise.offload(model, "decoder-llm", device=device, budget=total // 4)
        logits, seconds = timed(model, ids, 3)
        in_file = [m for m in model.modules() if file_tier.in_file(m)]
        pinned = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for m in model.modules()
                  for p in m.parameters(recurse=False) if file_tier.in_memory(p) and p.is_pinned()}
        held = sum(p.nbytes for m in model.modules() for p in m.parameters(recurse=False)
                   if file_tier.in_memory(p) and p.is_pinned())
        return {
            "load": str(loaded.report).splitlines()[-1], "placing": str(report).splitlines()[0],
            "modules reading their file": len(in_file), "identical_to_resident": bool(torch.equal(logits, expected)),
            "ms": seconds * 1e3, "resident_ms": resident_seconds * 1e3,
            "pinned regions": len(pinned), "pinned region bytes": sum(pinned.values()),
            "pinned tensor bytes": held, "placing's pinned bytes": report.pinned_bytes,
            "pinned by torch's host allocator": torch.cuda.host_memory_stats().get("allocated_bytes.current"),
        }



def leased_host_tier(host: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> dict:
    """The whole model on the host tier, mapped under a read lease, a quarter placed on the device and the rest
    pinned; then the file overwritten with zeros under it. The logits must stay transformers' resident ones."""
    from pathlib import Path

    with lease_folder() as folder:
        host.save_pretrained(folder)
        reference = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=host.dtype).eval().to(device)
        expected, _ = timed(reference, ids, 1)
        del reference
        file = Path(folder, "model.safetensors")
        started = time.perf_counter()
        model = streamwise.load_pretrained(folder, "decoder-llm", progress=False).model
        loaded = time.perf_counter() - started
        weights = list(model.parameters())
        mapped_at_load = viewing_file(weights, file)
        total = sum(p.nbytes for p in weights)
        streamwise.offload(model, "decoder-llm", device=device, budget=total // 4)
        before, _ = timed(model, ids, 1)
        mapped_after_placing = viewing_file(weights, file)
        held = rewrite(file)
        after, _ = timed(model, ids, 1)
        return {
            "file system": file_system(folder), "load seconds": loaded,
            "weights viewing the file after the load": f"{mapped_at_load}/{len(weights)}",
            "weights viewing the file after placing": f"{mapped_after_placing}/{len(weights)}",
            "identical to resident before the rewrite": bool(torch.equal(before, expected)),
            "writer held for (s)": held,
            "weights viewing the file after the rewrite": viewing_file(weights, file),
            "identical to resident after the rewrite": bool(torch.equal(after, expected)),
        }


if __name__ == "__main__":
    main()
