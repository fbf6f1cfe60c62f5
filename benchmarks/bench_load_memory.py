"""Peak RAM while `streamwise.load` fills a skeleton from a ~500 MB safetensors checkpoint.

A Qwen2-style model is written to a temporary folder by transformers, then a fresh process builds
the skeleton, loads the file and reports its peak resident memory (VmHWM) above what it held
before the load (after reading every loaded byte once), as a multiple of the file size.
Goal: at most 1.2x. Run:

    python benchmarks/bench_load_memory.py [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from report import recorded  # this folder's: results/<name>-<date>.md

CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)

MEASURE = r"""
import json, sys, torch, transformers, streamwise

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

config = transformers.Qwen2Config(**json.loads(sys.argv[2]))
with streamwise.skeleton():
    model = transformers.Qwen2ForCausalLM(config)
before = rss("VmRSS:")
report = streamwise.load(model, sys.argv[1], "decoder-llm")
with torch.no_grad():  # read every byte once, as a first forward would, so the mapping is really resident
    checksum = sum(float(p.sum()) for p in model.parameters())
peak = rss("VmHWM:")
total = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"before": before, "peak": peak, "loaded_bytes": total, "tensors": report.tensors}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    config = dict(CONFIG, num_hidden_layers=args.layers)
    with tempfile.TemporaryDirectory() as folder:
        write = (
            "import json, sys, torch, transformers\n"
            "torch.manual_seed(0)\n"
            "model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**json.loads(sys.argv[2])))\n"
            "model.save_pretrained(sys.argv[1])\n"
        )
        subprocess.run([sys.executable, "-c", write, folder, json.dumps(config)], check=True)
        path = Path(folder) / "model.safetensors"
        size = path.stat().st_size
        result = json.loads(subprocess.run(
            [sys.executable, "-c", MEASURE, str(path), json.dumps(config)], check=True, capture_output=True, text=True,
        ).stdout)
    growth = result["peak"] - result["before"]
    print(f"checkpoint {size / 2**20:.0f} MiB, {result['tensors']} tensors")
    print(f"RSS before load {result['before'] / 2**20:.0f} MiB, peak {result['peak'] / 2**20:.0f} MiB, "
          f"growth {growth / 2**20:.0f} MiB = {growth / size:.2f}x the file (goal <= 1.2x)")


if __name__ == "__main__":
    with recorded("load_memory"):
        main()
