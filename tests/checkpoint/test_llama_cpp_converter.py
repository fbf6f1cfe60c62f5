"""GGUF files llama.cpp's own converter wrote (`tests/fixtures/llama_cpp_converter`, made by its `make_fixtures.py`),
one tiny model per architecture Streamwise lists, each loaded from the `.gguf` alone and compared with the float
model it was converted from (saved beside it with `save_pretrained`), never only with transformers' GGUF loader:
that peer builds T5 with the wrong activation and computes the same wrong numbers.
"""

from __future__ import annotations

import json

import gguf
import pytest
import torch
import transformers

import streamwise
from streamwise.runtime.checkpoint import CheckpointError
from streamwise.runtime.checkpoint.llama_cpp import supported_architectures
from streamwise.runtime.convert import applied_state

from llama_cpp_files import CONVERTER_FIXTURES, model_output, write_gguf

FIXTURES = CONVERTER_FIXTURES
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
# the relative error of the output against the float model: an F16 file computes in float16; Q8_0 adds its rounding
BOUNDS = {"f16": 3e-3, "q8_0": 5e-2}
# Linear layers no GGUF resident can serve: Falcon's own Linear class computes `x @ weight.T` itself; GPT-2's
# Conv1D holds its weights transposed (transformers' processor transposes the values)
FLOAT_LINEARS = {"falcon", "gpt2"}
BUILT_AS = {"MistralForCausalLM": "LlamaForCausalLM"}  # llama.cpp writes Mistral as `llama`; both compute alike
IDS = torch.tensor([[1, 5, 17, 42, 33, 7, 60, 2]])


@pytest.fixture(scope="module")
def float_outputs():
    computed = {}

    def compute(family):
        if family not in computed:
            (name,) = json.loads((FIXTURES / family / "config.json").read_text())["architectures"]
            model = getattr(transformers, name).from_pretrained(FIXTURES / family, dtype=torch.float32).eval()
            computed[family] = (name, model_output(model, IDS))
        return computed[family]

    return compute


@pytest.mark.parametrize("outtype", list(BOUNDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_file_alone_computes_what_its_float_model_computes(family, outtype, float_outputs):
    path = FIXTURES / f"{family}.{outtype}.gguf"
    class_name, expected = float_outputs(family)

    model, report, _ = streamwise.load_pretrained(path, "auto")

    assert type(model).__name__ == BUILT_AS.get(class_name, class_name)
    if outtype == "q8_0":  # each block kept, or dequantized saying why
        kept = set(report.quantized.values())  # the converter keeps F16 where a row is no whole block
        assert "Q8_0" in kept and kept <= {"Q8_0", "F16"} if family not in FLOAT_LINEARS else not kept
        assert all(why.startswith("dequantized from Q8_0") or why.startswith("assembled by")
                   for why in report.dequantized_tensors.values())
    got = model_output(model, IDS)
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < BOUNDS[outtype], f"{family} {outtype}: {error:.2e} off the float model"
    placed = streamwise.offload(model, applied_state(model).plan.policy, device="cpu", budget=0)
    assert placed.resident_modules == 0 and placed.streamed_modules > 0
    assert torch.equal(model_output(model, IDS), got)  # every weight streamed computes what resident ones did


def test_the_architectures_listed_are_exactly_those_the_fixtures_prove():
    proven = {gguf.GGUFReader(FIXTURES / f"{family}.f16.gguf").fields["general.architecture"].contents()
              for family in FAMILIES}
    assert supported_architectures() == sorted(proven)


def test_an_architecture_no_test_proves_is_refused_by_name_before_transformers_reads_it(tmp_path):
    """gpt-oss: transformers' reader accepts the architecture; Streamwise has no converter-made file proving it."""
    path = tmp_path / "gpt-oss.gguf"
    write_gguf(path, "gpt-oss", {"token_embd.weight": torch.zeros(8, 32).numpy()}, {"gpt-oss.block_count": 1})
    with pytest.raises(CheckpointError) as caught:
        streamwise.load_pretrained(path, "auto")
    text = str(caught.value)
    assert str(path) in text and "`gpt-oss`" in text and "cannot build right" in text and "t5encoder" in text


def rewritten(family: str, path, **changes) -> None:
    """The converter's F16 file of `family` written again, its tokenizer too, with some of its architecture's
    metadata changed."""
    source = gguf.GGUFReader(FIXTURES / f"{family}.f16.gguf")
    architecture = source.fields["general.architecture"].contents()
    metadata = {field.name: field.contents() for field in source.fields.values()
                if field.name.startswith((f"{architecture}.", "tokenizer."))}
    write_gguf(path, architecture, {t.name: (t.data, t.tensor_type) for t in source.tensors},
               {**metadata, **{f"{architecture}.{key}": value for key, value in changes.items()}})


def test_a_falcon_with_several_key_value_groups_is_refused_by_name(tmp_path):
    """llama.cpp's converter regroups a Falcon-40B's fused QKV rows; Streamwise does not undo that, so it refuses."""
    path = tmp_path / "falcon-40b-like.gguf"
    rewritten("falcon", path, **{"attention.head_count_kv": 2})
    with pytest.raises(CheckpointError, match="Falcon with 2 key-value groups"):
        streamwise.load_pretrained(path, "auto")


@pytest.mark.parametrize("family", ["llama", "mamba"])
def test_no_heads_is_refused_where_the_file_holds_attention_and_only_there(tmp_path, family):
    """Mamba's converter writes a head count of 0 (its file holds no attention projection); a Llama claiming 0 heads
    is a lie, and so is a Mamba claiming 0 for a size that cannot be 0."""
    heads = tmp_path / f"{family}-no-heads.gguf"
    rewritten(family, heads, **{"attention.head_count": 0})
    if family == "llama":
        with pytest.raises(CheckpointError, match="attention.head_count` is 0; it must be at least 1"):
            streamwise.load_pretrained(heads, "auto")
    else:
        streamwise.load_pretrained(heads, "auto")
    empty = tmp_path / f"{family}-no-width.gguf"
    rewritten(family, empty, **{"embedding_length": 0})
    with pytest.raises(CheckpointError, match="embedding_length` is 0; it must be at least 1"):
        streamwise.load_pretrained(empty, "auto")


def test_a_llama_3_file_keeps_its_rope_scaling_from_rope_freqs():
    """llama.cpp's converter stores Llama 3.1's rope scaling as `rope_freqs` and no metadata key: the frequencies
    divided by it are the float model's, and a long prompt (where they matter) computes what the float model does."""
    folder = FIXTURES / "llama3"
    float_model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, report, _ = streamwise.load_pretrained(FIXTURES / "llama3.f16.gguf", "auto")

    (rotary,) = [m for m in model.modules() if hasattr(m, "inv_freq")]
    torch.testing.assert_close(rotary.inv_freq, float_model.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert not torch.equal(rotary.original_inv_freq, 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16)))
    ids = torch.arange(120).remainder(60).add(1).unsqueeze(0)
    expected = model_output(float_model, ids)
    assert ((model_output(model, ids) - expected).norm() / expected.norm()).item() < 3e-3
