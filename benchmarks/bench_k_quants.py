"""How long `streamwise quantize` takes to write K-quants: `runtime/quant/k_quants.py` on a 4096 x 4096 float32
matrix (a 7B model's attention projection), each type timed once after a warm-up, beside the gguf package's Q8_0
and Q4_0 quantizers, and the time a 6.74 B-parameter model (Llama 2 7B) would take at that rate. Run:

    python benchmarks/bench_k_quants.py

Figures go to `results/k-quants-<date>.md`.
"""

from __future__ import annotations

import time

import gguf
import numpy as np
from report import recorded  # this folder's: results/<name>-<date>.md

PARAMETERS_7B = 6.74e9


def main() -> None:
    from streamwise.runtime.quant import k_quants

    x = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)
    sides = {qtype.name: (lambda q=qtype: k_quants.quantize(x, q)) for qtype in k_quants.QUANTIZERS}
    for name in ("Q8_0", "Q4_0"):
        sides[f"{name} (gguf package)"] = lambda q=gguf.GGMLQuantizationType[name]: gguf.quants.quantize(x, q)
    print("| type | 4096 x 4096 | a 7B model at that rate |")
    print("|---|---|---|")
    for name, run in sides.items():
        run()  # warm-up
        started = time.perf_counter()
        run()
        seconds = time.perf_counter() - started
        print(f"| {name} | {seconds:.2f} s | {seconds / x.size * PARAMETERS_7B / 60:.1f} min |")


if __name__ == "__main__":
    with recorded("k-quants"):
        main()
