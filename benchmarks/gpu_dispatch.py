"""GPU check for `streamwise.dispatch`: a tiny random Qwen2 split across every accelerator here plus the CPU.

Each accelerator's budget holds the embedding and about a third of the blocks, so the blocks spread over the
devices in order and the tail (the last blocks, the final norm, `lm_head`) lands in the `"cpu"` entry, which
Streamwise streams onto the last accelerator. The logits are compared with the unconverted model on the first
accelerator; the device map, bytes per device, a warm forward's time and each device's peak memory are printed as
JSON (also to --out). Needs accelerate and transformers. Run on a machine with at least one CUDA device:

    python benchmarks/gpu_dispatch.py [--layers 12] [--out results/gpu_dispatch.json]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter

from report import emit  # this folder's: every GPU benchmark hands over its figures alike


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import transformers
    from accelerate.utils import compute_module_sizes

    import streamwise

    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check", file=sys.stderr)
        return 2
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=args.layers,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)
    model = transformers.Qwen2ForCausalLM(config).eval()
    reference = copy.deepcopy(model).to(devices[0])
    sizes = compute_module_sizes(model)
    share = sizes["model.embed_tokens"] + sizes["lm_head"] + (args.layers // 3) * sizes["model.layers.0"] + 2**20
    max_memory = {device: share for device in devices} | {"cpu": "8GiB"}

    report = streamwise.dispatch(model, "decoder-llm", max_memory=max_memory)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    with torch.inference_mode():
        expected = reference(ids.to(devices[0])).logits
        model(ids)  # warm
        for device in devices:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        logits = model(ids).logits
        for device in devices:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    logits = logits.to(expected.device)
    result = {
        "devices": devices,
        "max_memory": {k: int(v) if not isinstance(v, str) else v for k, v in max_memory.items()},
        "modules_per_device": dict(Counter(report.device_map.values())),
        "bytes_per_device": report.bytes,
        "streamed_modules": report.streamed_modules,
        "resident_modules": report.resident_modules,
        "identical": bool(torch.equal(logits, expected)),
        "max_abs_difference": float((logits - expected).abs().max()),
        "warm_forward_s": round(seconds, 4),
        "peak_allocated": {d: torch.cuda.max_memory_allocated(d) for d in devices},
        "device_map": report.device_map,
    }
    emit(result, args.out)
    ok = result["max_abs_difference"] <= 1e-4 and "cpu" in result["modules_per_device"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
