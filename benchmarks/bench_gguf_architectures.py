"""Each GGUF architecture Streamwise lists, against its float model: the relative error of the output of the file
llama.cpp's converter wrote (`tests/fixtures/llama_cpp_converter`, one tiny model per family at F16 and Q8_0),
loaded alone by `streamwise.load_pretrained(file, "auto")`, and the same for transformers' own GGUF loader, the peer
(`from_pretrained(folder, gguf_file=...)`, which dequantizes everything).

The K-quant columns need rows of 256 values (the fixtures' are 32): each family again at width 256
(`make_fixtures.save_float_model` with `WIDE`), written by `streamwise quantize --layout llama.cpp` as Q6_K and as
llama-quantize's Q4_K_M mix (the layout and the mix are held to llama.cpp's own tools by the tests), loaded alone.
Run:

    python benchmarks/bench_gguf_architectures.py

Figures go to `results/gguf-architectures-<date>.md`.
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

sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402  (the families' configs)

IDS = torch.tensor([[1, 5, 17, 42, 33, 7, 60, 2]])
# each family at width 256, so that every weight matrix's rows fill K-quant blocks
WIDE = dict(hidden_size=256, n_embd=256, d_model=256, intermediate_size=512, d_ff=512, block_ff_dim=512, head_dim=64,
            d_kv=64, num_attention_heads=4, n_head=4, num_heads=4, moe_intermediate_size=256,
            shared_expert_intermediate_size=512, time_step_rank=16)
K_QUANTS = ("Q6_K", "Q4_K_M")


def error(got: torch.Tensor, expected: torch.Tensor) -> str:
    return f"{((got - expected).norm() / expected.norm()).item():.1e}"


def peer_error(path: Path, name: str, expected: torch.Tensor) -> str:
    """transformers' own GGUF load of `path` against the float model, or how it fails (a figure too)."""
    try:
        model = getattr(transformers, name).from_pretrained(path.parent, gguf_file=path.name).eval()
    except Exception as exc:
        return f"fails ({type(exc).__name__})"
    return error(model_output(model, IDS), expected)


def k_quant_errors(family: str, scratch: Path) -> list[str]:
    """The family at width 256 written as each of `K_QUANTS` in llama.cpp's layout, loaded alone, against its float
    model, with the types its weights took."""
    import gguf

    import streamwise
    from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf

    folder = scratch / family
    make_fixtures.save_float_model(family, folder, vocab_size=1024, **WIDE)  # a vocabulary wider than any layer
    (name,) = json.loads((folder / "config.json").read_text())["architectures"]
    float_model = getattr(transformers, name).from_pretrained(folder, dtype=torch.float32).eval()
    expected = model_output(float_model, IDS)
    errors = []
    for gguf_type in K_QUANTS:
        path = scratch / f"{family}.{gguf_type}.gguf"
        quantize_to_gguf(folder, path, "auto", float_model, gguf_type=gguf_type, layout="llama.cpp")
        kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.tensor_type.name not in ("F32", "F16")}
        try:
            model, how = streamwise.load_pretrained(path, "auto")[0], ""
        except streamwise.Error:  # LFM2's config reads the token list a tokenizer-less tiny model has not
            model, how = streamwise.load_pretrained(folder, "auto", dtype=torch.float32)[0], ", its config.json"
            streamwise.load(model, path, "auto", dtype=torch.float32)
        errors.append(f"{error(model_output(model, IDS), expected)} ({'+'.join(sorted(kinds))}{how})")
    return errors


def main() -> None:
    import tempfile

    import gguf

    import streamwise

    print("| family | architecture | class built | F16 | Q8_0 | transformers F16 | transformers Q8_0 | "
          "width 256: Q6_K | width 256: Q4_K_M |")
    print("|---|---|---|---|---|---|---|---|---|")
    scratch = tempfile.TemporaryDirectory()
    for folder in sorted(p for p in FIXTURES.iterdir() if (p / "config.json").is_file()):
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
        k_quants = k_quant_errors(folder.name, Path(scratch.name))
        print(f"| {folder.name} | `{architecture}` | {built} | {' | '.join(ours)} | {' | '.join(theirs)} | "
              f"{' | '.join(k_quants)} |")
        sys.stdout.flush()


if __name__ == "__main__":
    with recorded("gguf-architectures"):
        main()
