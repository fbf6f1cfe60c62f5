"""Each GGUF architecture Streamwise lists, against its float model: the relative error of the output of the file
llama.cpp's converter wrote (`tests/fixtures/llama_cpp_converter`, one tiny model per family at F16 and Q8_0),
loaded alone by `streamwise.load_pretrained(file, "auto")`, and the same for transformers' own GGUF loader, the peer
(`from_pretrained(folder, gguf_file=...)`, which dequantizes everything). Run:

    python benchmarks/bench_gguf_architectures.py

Figures go to `results/gguf-architectures-<date>.md`. A K-quant column waits on K-quant writing (issue 53).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from report import recorded  # this folder's: results/<name>-<date>.md

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from llama_cpp_files import CONVERTER_FIXTURES as FIXTURES  # noqa: E402  (the fixtures and how they are run)
from llama_cpp_files import model_output  # noqa: E402

IDS = torch.tensor([[1, 5, 17, 42, 33, 7, 60, 2]])


def error(got: torch.Tensor, expected: torch.Tensor) -> str:
    return f"{((got - expected).norm() / expected.norm()).item():.1e}"


def peer_error(path: Path, name: str, expected: torch.Tensor) -> str:
    """transformers' own GGUF load of `path` against the float model, or how it fails (a figure too)."""
    try:
        model = getattr(transformers, name).from_pretrained(path.parent, gguf_file=path.name).eval()
    except Exception as exc:
        return f"fails ({type(exc).__name__})"
    return error(model_output(model, IDS), expected)


def main() -> None:
    import gguf

    import streamwise

    print("| family | architecture | class built | F16 | Q8_0 | transformers F16 | transformers Q8_0 |")
    print("|---|---|---|---|---|---|---|")
    for folder in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        (name,) = json.loads((folder / "config.json").read_text())["architectures"]
        expected = model_output(getattr(transformers, name).from_pretrained(folder, dtype=torch.float32).eval(), IDS)
        architecture = gguf.GGUFReader(FIXTURES / f"{folder.name}.f16.gguf").fields["general.architecture"].contents()
        ours, theirs, built = [], [], ""
        for outtype in ("f16", "q8_0"):
            path = FIXTURES / f"{folder.name}.{outtype}.gguf"
            model, _, _ = streamwise.load_pretrained(path, "auto")
            built = type(model).__name__
            ours.append(error(model_output(model, IDS), expected))
            theirs.append(peer_error(path, name, expected))
        print(f"| {folder.name} | `{architecture}` | {built} | {' | '.join(ours)} | {' | '.join(theirs)} |")
        sys.stdout.flush()


if __name__ == "__main__":
    with recorded("gguf-architectures"):
        main()
