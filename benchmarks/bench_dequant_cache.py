"""Per-call dequant against dequantizing each resident once per forward, on Q8_0 GGUF models written by `quantize`.

Three ways to run the same loaded model's forward, interleaved round after round, median of `--runs`:
- `per call`: every call of a resident expands its weight (the dequant cache off, bound 0);
- `cached`: the process's dequant cache at its default bound (`runtime/quant/dequant_cache.py`);
- `once per forward`: an oracle that expands each resident at its first call in a forward and serves every later call
  of that forward from it (a memo cleared before each forward, unbounded).
Goal: `cached` no slower than `once per forward`. Models: an ALBERT (one shared layer applied at every depth: its
residents are called 12 times per forward) and a Qwen2 (each resident called once per forward; more float bytes
than the bound). Outputs of the three are checked equal. GGUF weights expand with numba's fused CPU kernels where it is
installed, with the torch kernels under `--torch-kernels`. Run:

    python benchmarks/bench_dequant_cache.py [--out benchmarks/results/dequant_cache-DATE] [--runs 5] [--torch-kernels]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from streamwise.runtime.checkpoint.pretrained import load_pretrained
from streamwise.runtime.quant import dequant_cache


def albert(folder: Path) -> None:
    from transformers import AlbertConfig, AlbertModel

    config = AlbertConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                          embedding_size=256, vocab_size=1024)
    AlbertModel(config).save_pretrained(folder)


def qwen2(folder: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)
    Qwen2ForCausalLM(config).save_pretrained(folder)


MODELS = {"ALBERT, 12 depths of 1 shared layer, hidden 1024": albert, "Qwen2, 4 layers, hidden 2048": qwen2}


class OncePerForward:
    """The oracle: each resident expanded at its first call of a forward (`clear` between forwards)."""

    bound = 0

    def __init__(self) -> None:
        self.memo: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def weight(self, module, stored, dtype, device, size, expand):
        key = (id(module), dtype)
        if key not in self.memo:
            self.memo[key] = expand()
        return self.memo[key]

    def clear(self) -> None:
        self.memo.clear()


def gguf_model(build, folder: Path) -> Path:
    torch.manual_seed(0)
    build(folder)
    path = folder / "model.Q8_0.gguf"
    subprocess.run([sys.executable, "-m", "streamwise", "quantize", str(folder), str(path), "--type", "Q8_0"],
                   check=True, capture_output=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", metavar="STEM", help="write STEM.md")
    parser.add_argument("--torch-kernels", action="store_true",
                        help="numba's fused CPU kernels off (as without the cpu-kernels extra): the torch kernels")
    args = parser.parse_args()
    if args.torch_kernels:
        sys.modules["numba"] = None  # its import fails: `gguf_dequant` keeps the torch kernels
    cached, oracle = dequant_cache.DEQUANT_CACHE, OncePerForward()
    modes = {"per call": dequant_cache.DequantCache(0), "cached": cached, "once per forward": oracle}
    lines = [f"# Per-call dequant against once per forward ({datetime.date.today()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, {args.tokens} tokens, median of {args.runs} interleaved runs)", "",
             f"`python benchmarks/bench_dequant_cache.py {' '.join(sys.argv[1:])}`; cache bound "
             f"{cached.bound >> 20} MiB", "", "| model | per call | cached | once per forward | cached held | goal |",
             "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        for name, build in MODELS.items():
            model = load_pretrained(gguf_model(build, Path(scratch) / build.__name__), progress=False).model
            ids = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(0))
            times = {mode: [] for mode in modes}
            outputs = {}
            for round_ in range(args.runs + 1):  # the first round warms every mode (and fills the cache)
                for mode, cache in modes.items():
                    dequant_cache.DEQUANT_CACHE = cache
                    oracle.clear()
                    with torch.inference_mode():
                        start = time.perf_counter()
                        outputs[mode] = model(ids)[0]
                        seconds = time.perf_counter() - start
                    if round_:
                        times[mode].append(seconds)
            dequant_cache.DEQUANT_CACHE = cached
            assert all(torch.equal(output, outputs["per call"]) for output in outputs.values()), name
            median = {mode: statistics.median(samples) for mode, samples in times.items()}
            verdict = "met" if median["cached"] <= median["once per forward"] * 1.05 else "NOT met"
            lines.append(f"| {name} | " + " | ".join(f"{median[mode] * 1e3:.0f} ms" for mode in modes)
                         + f" | {cached.held >> 20} MiB | {verdict} (within 5%) |")
            print(lines[-1], flush=True)
            cached.clear()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(f"{args.out}.md").write_text(text)


if __name__ == "__main__":
    main()
