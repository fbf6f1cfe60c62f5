"""A `.gguf` written by `streamwise quantize` stands alone: it carries its model's config.json and tokenizer files,
so `load_pretrained(file.gguf)` builds and loads the model, and `load_tokenizer` its tokenizer, with nothing beside
it; the model computes exactly what the same file loaded beside its config computes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import gguf
import pytest
import torch
import transformers

import streamwise
from streamwise.runtime.checkpoint import CheckpointError, load_tokenizer
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
from streamwise.runtime.cli.streamwise import main

from helpers import gguf_policy, tiny_diffusers, tiny_qwen2, tiny_tokenizer


def _t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=1, eos_token_id=2)
    return transformers.T5ForConditionalGeneration(config).eval()


CASES = {  # name: (the float model, the policy its quantized file is written with, one forward's inputs)
    "decoder": (lambda: tiny_qwen2(tie_word_embeddings=False), "decoder-llm",
                dict(input_ids=torch.tensor([[3, 1, 4, 1, 5, 9]]))),
    "encoder-decoder": (_t5, "transformers",
                        dict(input_ids=torch.tensor([[3, 1, 4, 1, 5, 9]]), decoder_input_ids=torch.tensor([[0, 7]]))),
    "diffusers": (lambda: tiny_diffusers("transformer")[0], "any-module", tiny_diffusers("transformer")[1]),
}


def _output(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.sample


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_gguf_alone_loads_and_computes_as_beside_its_config(tmp_path, case):
    build, base, inputs = CASES[case]
    folder = tmp_path / "model"
    model = build()
    model.save_pretrained(folder)
    if case != "diffusers":
        tiny_tokenizer().save_pretrained(folder)
    weights = next(folder.glob("*.safetensors"))
    report = quantize_to_gguf(weights, folder / "model.Q8_0.gguf", gguf_policy(tmp_path, "Q8_0", base), model)
    assert "config.json" in report.carried and report.types.get("Q8_0", 0) > 0
    assert ("tokenizer.json" in report.carried) == (case != "diffusers")
    alone = tmp_path / "alone" / "model.Q8_0.gguf"
    alone.parent.mkdir()
    shutil.copy(folder / "model.Q8_0.gguf", alone)

    beside = streamwise.load_pretrained(folder / "model.Q8_0.gguf", progress=False)
    loaded = streamwise.load_pretrained(alone, progress=False)

    assert type(loaded.model) is type(beside.model) and loaded.report.quantized == beside.report.quantized
    assert loaded.report.quantized  # its layers stay quantized
    assert torch.equal(_output(loaded.model, inputs), _output(beside.model, inputs))
    assert list(tmp_path.glob("alone/*")) == [alone]  # nothing left beside it
    if case != "diffusers":  # the tokenizer transformers makes of the folder, rebuilt from the file alone
        carried, original = load_tokenizer(alone), load_tokenizer(folder)
        assert type(carried) is type(original) and carried.get_vocab() == original.get_vocab() != {}
        assert carried("the quick brown fox w7").input_ids == original("the quick brown fox w7").input_ids


def test_a_generated_text_from_a_decoder_gguf_alone_matches_the_one_beside_its_config(tmp_path):
    folder = tmp_path / "model"
    model = tiny_qwen2(tie_word_embeddings=False)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert main(["quantize", str(folder), str(tmp_path / "q.gguf"), "--type", "Q8_0"]) == 0
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=1)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    alone = streamwise.load_pretrained(tmp_path / "q.gguf", progress=False).model
    shutil.copy(tmp_path / "q.gguf", folder / "q.gguf")
    beside = streamwise.load_pretrained(folder / "q.gguf", progress=False).model
    assert torch.equal(alone.generate(ids, **greedy), beside.generate(ids, **greedy))


def test_quantize_says_whether_the_file_stands_alone(tmp_path, capsys):
    folder = tmp_path / "model"
    tiny_qwen2().save_pretrained(folder)
    assert main(["quantize", str(folder), str(tmp_path / "q.gguf"), "--type", "Q8_0"]) == 0
    out = capsys.readouterr().out
    assert "carries config.json" in out and "no tokenizer" in out and "loads alone" in out


def test_a_streamwise_gguf_carrying_no_config_says_how_to_make_it_load(tmp_path):
    path = tmp_path / "old.gguf"
    writer = gguf.GGUFWriter(str(path), arch="streamwise")  # as versions before carried files wrote it
    writer.add_tensor("lm_head.weight", torch.zeros(4, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"old\.gguf: a GGUF Streamwise wrote without its model's config\.json"
                                              r".*put the model's config\.json .* beside it.*streamwise quantize"):
        streamwise.load_pretrained(path, progress=False)


@pytest.mark.parametrize("strings, problem", [
    ({"streamwise.files": "../evil.py"}, r"`streamwise.files` names \.\./evil\.py; a GGUF carries only config\.json"),
    ({"streamwise.files": "config.json"}, r"names config\.json, but no string `streamwise\.file\.config\.json`"),
    ({"streamwise.files": "spiece.model", "streamwise.file_base64.spiece.model": "not base64!"},
     r"`streamwise\.file_base64\.spiece\.model` is not base64"),
])
def test_hostile_carried_files_are_refused_naming_the_key(tmp_path, strings, problem):
    path = tmp_path / "hostile.gguf"
    writer = gguf.GGUFWriter(str(path), arch="streamwise")
    for key, value in strings.items():
        writer.add_string(key, value)
    writer.add_tensor("w", torch.zeros(4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=problem):
        streamwise.load_pretrained(path, progress=False)
    assert not list(tmp_path.glob("evil*")) and [p.name for p in tmp_path.iterdir()] == ["hostile.gguf"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a file-size limit is set in a POSIX child")
def test_quantize_stopped_by_a_file_size_limit_says_why_and_leaves_no_file(tmp_path):
    import resource

    folder = tmp_path / "model"
    tiny_qwen2().save_pretrained(folder)
    limit = 64 << 10

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    done = subprocess.run([sys.executable, "-m", "streamwise", "quantize", str(folder), str(tmp_path / "q.gguf"),
                           "--type", "Q8_0"], preexec_fn=limited, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert f"writing stopped after {limit} bytes" in done.stderr
    assert f"this process may write files of at most {limit} bytes (`ulimit -f`): raise the limit" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no partial file, no destination


def test_quantize_refuses_a_model_with_tensors_a_gguf_cannot_hold_before_writing(tmp_path):
    """A Conv3d patch embedding (GLM-4V's) has 5 dimensions; llama.cpp's GGUF holds 4: refused, nothing written."""
    folder = tmp_path / "model"
    model = tiny_qwen2()
    model.register_buffer("patch", torch.zeros(2, 3, 2, 2, 2))  # persistent: saved beside the weights
    model.save_pretrained(folder)
    with pytest.raises(CheckpointError, match=r"a GGUF holds tensors of at most 4 dimensions \(llama.cpp's limit\), "
                                              r"and 1 here have more: patch; keep this model in safetensors"):
        quantize_to_gguf(folder, tmp_path / "q.gguf", "decoder-llm", tiny_qwen2())
    assert not (tmp_path / "q.gguf").exists()
