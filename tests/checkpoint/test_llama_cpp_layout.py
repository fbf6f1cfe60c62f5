"""`streamwise quantize --layout llama.cpp`: a transformers folder written as llama.cpp's converter writes it, held to
files llama.cpp's own tools wrote of the same folders (`tests/fixtures/llama_cpp_converter`, `make_fixtures.py`):

- each listed family at F16: the converter's tensor names, types, shapes and bytes, and its metadata, key for key;
- at Q4_K_M: llama-quantize's output of the converter's file, byte for byte;
- SentencePiece tokenizers (BPE as `llama`, T5's Unigram as `t5`): the converter's tokenizer keys, key for key;
- byte-level BPE tokenizers llama.cpp ships (where its vocabularies were fetched): its own keys, named by its table;
- the file loads alone in Streamwise and computes what the float model computes; llama.cpp runs it where a build is
  named (`STREAMWISE_LLAMA_CPP_BIN`, the folder holding `llama-simple`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

import streamwise
from streamwise.runtime.checkpoint import CheckpointError, load_tokenizer
from streamwise.runtime.cli.streamwise import main as streamwise_main

from llama_cpp_files import CONVERTER_FIXTURES, model_output, vocabulary

FAMILIES = sorted(p.name for p in CONVERTER_FIXTURES.iterdir() if (p / "config.json").is_file())
TOKENIZERS = CONVERTER_FIXTURES / "tokenizers"
LLAMA_QUANTIZE = CONVERTER_FIXTURES.parent / "llama_quantize"
# The converter adds Gemma's and Nemotron's norm offset and computes Mamba's A = -exp(A_log) in the source's float16,
# then widens to F32; Streamwise computes them in F32: the two differ by the converter's rounding, a float16 unit
ARITHMETIC = ("norm.weight", "ssm_a")
IDS = torch.tensor([[1, 5, 17, 42, 33, 7, 60, 2]])


def write(folder: Path, target: Path, gguf_type: str) -> None:
    assert streamwise_main(["quantize", str(folder), str(target), "--type", gguf_type, "--layout", "llama.cpp"]) == 0


def metadata(path: Path, tokenizer: bool = False) -> dict:
    """A file's llama.cpp keys (its tokenizer's, or the others), but the name the converter takes from the folder and
    its size label; Streamwise's own (the model's files it carries) are left to `carried`."""
    reader = gguf.GGUFReader(path)
    return {key: (field.types[0], field.contents()) for key, field in reader.fields.items()
            if not key.startswith(("GGUF.", "streamwise.")) and key not in ("general.name", "general.size_label")
            and key.startswith("tokenizer.") == tokenizer}


def carried(path: Path) -> list[str]:
    return gguf.GGUFReader(path).fields["streamwise.files"].contents().split(",")


def without_files(path: Path) -> Path:
    """`path` rewritten as llama.cpp's tools alone would have it: Streamwise's keys (the model's files) taken out."""
    reader = gguf.GGUFReader(path)
    alone = path.with_name(f"alone-{path.name}")
    writer = gguf.GGUFWriter(alone, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "streamwise.")) and key != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if array else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return alone


def tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_written_as_the_converter_writes_it(tmp_path, family):
    target = tmp_path / f"{family}.f16.gguf"
    write(CONVERTER_FIXTURES / family, target, "F16")
    theirs, ours = CONVERTER_FIXTURES / f"{family}.f16.gguf", target

    assert metadata(ours) == metadata(theirs)
    expected, got = tensors(theirs), tensors(ours)
    assert sorted(got) == sorted(expected)
    for name, reference in expected.items():
        mine = got[name]
        assert (mine.tensor_type, list(mine.shape)) == (reference.tensor_type, list(reference.shape)), name
        if name.endswith(ARITHMETIC) and family in ("gemma2", "gemma3_text", "nemotron", "mamba"):
            unit = np.spacing(np.abs(np.asarray(reference.data)).astype(np.float16)).astype(np.float32)
            assert (np.abs(mine.data - reference.data) <= unit).all(), name
        else:
            assert np.array_equal(np.asarray(mine.data).view(np.uint8), np.asarray(reference.data).view(np.uint8)), name


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_a_mix_written_from_the_folder_is_what_llama_quantize_makes_of_the_converters_file(tmp_path, family):
    target = tmp_path / f"{family}.q4_k_m.gguf"
    write(CONVERTER_FIXTURES / family, target, "Q4_K_M")
    reference = LLAMA_QUANTIZE / f"{family}.Q4_K_M.gguf"

    assert metadata(target) == metadata(reference)
    expected, got = tensors(reference), tensors(target)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(np.asarray(got[name].data).view(np.uint8), np.asarray(tensor.data).view(np.uint8)), name


@pytest.fixture(scope="module")
def float_outputs():
    computed = {}

    def compute(folder: Path):
        if folder not in computed:
            (name,) = json.loads((folder / "config.json").read_text())["architectures"]
            model = getattr(transformers, name).from_pretrained(folder, dtype=torch.float32).eval()
            computed[folder] = model_output(model, IDS)
        return computed[folder]

    return compute


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"lfm2"}))
def test_the_written_file_alone_computes_what_its_float_model_computes(tmp_path, family, float_outputs):
    """Built from llama.cpp's metadata, as llama.cpp builds it."""
    target = tmp_path / f"{family}.q8_0.gguf"
    write(CONVERTER_FIXTURES / family, target, "Q8_0")

    model, _, _ = streamwise.load_pretrained(target, "auto")

    expected = float_outputs(CONVERTER_FIXTURES / family)
    got = model_output(model, IDS)
    assert ((got - expected).norm() / expected.norm()).item() < 5e-2


def test_a_mistral_written_as_llama_reads_back_without_a_sliding_window_as_llama_cpp_runs_it(tmp_path):
    """transformers builds a `llama` file named Mistral as Mistral, with its class's 4096-token window; llama.cpp
    applies no window to `llama`, nor did the folder (Mistral v0.2 on)."""
    from streamwise.runtime.checkpoint.llama_cpp import gguf_config

    write(CONVERTER_FIXTURES / "mistral", tmp_path / "mistral.gguf", "Q8_0")
    config = gguf_config(tmp_path / "mistral.gguf")
    assert config.model_type == "mistral" and config.sliding_window is None


@pytest.mark.parametrize("name", ["llama-sentencepiece", "t5encoder-sentencepiece"])
def test_a_sentencepiece_tokenizer_is_written_as_the_converter_writes_it(tmp_path, name):
    target = tmp_path / f"{name}.gguf"
    write(TOKENIZERS / name, target, "F16")
    theirs = TOKENIZERS / f"{name}.f16.gguf"

    assert metadata(target, tokenizer=True) == metadata(theirs, tokenizer=True)
    assert metadata(target) == metadata(theirs)
    assert load_tokenizer(without_files(target))("the quick brown fox")["input_ids"] \
        == load_tokenizer(theirs)("the quick brown fox")["input_ids"]


def test_the_file_carries_the_folders_tokenizer_files_and_a_config_transformers_cannot_read_is_refused(tmp_path):
    """llama.cpp's metadata describes the model, as llama.cpp reads it; the model's files ride along (for its
    generation settings and tokenizer).
    transformers reads LFM2's config from the token list, which a file without a tokenizer lacks: refused, saying
    what to do."""
    write(CONVERTER_FIXTURES / "lfm2", tmp_path / "lfm2.gguf", "Q8_0")
    assert carried(tmp_path / "lfm2.gguf") == ["config.json", "generation_config.json", "tokenizer.json"]
    with pytest.raises(CheckpointError, match=r"lfm2.gguf: .* no tokenizer .* load it with its folder.s config"):
        streamwise.load_pretrained(tmp_path / "lfm2.gguf", "auto")


# llama.cpp's vocabulary -> a tiny model of the family whose tokenizer it is
BPE_FAMILIES = {"gpt-2": "gpt2", "qwen2": "qwen2", "falcon": "falcon", "starcoder": "starcoder2"}


@pytest.mark.parametrize("name", list(BPE_FAMILIES))
def test_a_bpe_tokenizer_is_written_with_llama_cpps_own_keys(tmp_path, name):
    """llama.cpp's own vocabulary, through transformers (`load_tokenizer`, `save_pretrained`) into a folder of its
    family and back into a GGUF: every tokenizer key llama.cpp wrote, its pre-tokenizer named by the converter's
    table."""
    source = vocabulary(name)
    tokens = gguf.GGUFReader(source).fields["tokenizer.ggml.tokens"].contents()
    folder = tmp_path / "folder"
    config = transformers.AutoConfig.from_pretrained(CONVERTER_FIXTURES / BPE_FAMILIES[name])
    config.vocab_size = len(tokens)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    write(folder, tmp_path / "model.gguf", "Q8_0")

    assert metadata(tmp_path / "model.gguf", tokenizer=True) == metadata(source, tokenizer=True)


def test_a_folder_without_a_tokenizer_llama_cpp_can_read_says_so_and_holds_none(tmp_path, capsys):
    write(CONVERTER_FIXTURES / "qwen2", tmp_path / "model.gguf", "Q8_0")  # a tokenizer.json of no real tokenizer

    assert metadata(tmp_path / "model.gguf", tokenizer=True) == {
        "tokenizer.ggml.model": (gguf.GGUFValueType.STRING, "none")}
    assert "tokenizer: none (transformers builds no tokenizer from it" in capsys.readouterr().out


def test_what_the_layout_cannot_hold_is_refused_naming_it(tmp_path):
    from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf

    folder = tmp_path / "rope"
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                              "rope_theta": 1e4})
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    with pytest.raises(CheckpointError, match="rope type `dynamic` is not written in llama.cpp's layout"):
        quantize_to_gguf(folder, tmp_path / "out.gguf", "auto", model, layout="llama.cpp")
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64, image_size=32, patch_size=16))
    vit.save_pretrained(tmp_path / "vit")
    with pytest.raises(CheckpointError, match="ViTModel: llama.cpp's layout is written for bloom, "):
        quantize_to_gguf(tmp_path / "vit", tmp_path / "out.gguf", "auto", vit, layout="llama.cpp")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.skipif(not os.environ.get("STREAMWISE_LLAMA_CPP_BIN"),
                    reason="no llama.cpp build named: STREAMWISE_LLAMA_CPP_BIN=<folder holding llama-simple>")
def test_llama_cpp_runs_the_written_file_and_continues_the_prompt_as_streamwise_does(tmp_path):
    binaries = Path(os.environ["STREAMWISE_LLAMA_CPP_BIN"])
    folder = TOKENIZERS / "llama-sentencepiece"
    write(folder, tmp_path / "model.gguf", "Q8_0")
    prompt = "the quick brown fox"
    run = subprocess.run([binaries / "llama-simple", "-m", tmp_path / "model.gguf", "-n", "8", prompt],
                         capture_output=True, timeout=120, env={**os.environ, "LD_LIBRARY_PATH": str(binaries)})
    assert run.returncode == 0, run.stderr[-2000:]
    model, _, _ = streamwise.load_pretrained(tmp_path / "model.gguf", "auto")
    tokenizer = load_tokenizer(tmp_path / "model.gguf")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    continued = model.generate(ids, max_new_tokens=8, do_sample=False)
    # llama-simple prints each token's bytes, the prompt's BOS too: a byte token its byte, a piece its text
    pieces = tokenizer.convert_ids_to_tokens(continued[0].tolist())
    printed = b"".join(bytes([int(piece[3:5], 16)]) if re.fullmatch(r"<0x[0-9A-F]{2}>", piece)
                       else piece.replace("\u2581", " ").encode() for piece in pieces)
    assert run.stdout.rstrip(b"\n") == printed
