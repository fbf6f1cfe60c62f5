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


def test_a_tensor_of_more_dimensions_than_a_gguf_holds_is_written_in_rows_and_read_back_whole(tmp_path):
    """A Conv3d patch embedding (Wan's, GLM-4V's) has 5 dimensions, a GGUF at most 4: written as rows of its first
    dimension with its shape under ComfyUI-GGUF's `comfy.gguf.orig_shape.<name>` (an INT32 array, as that reader
    checks), and read back in its own shape."""
    folder = tmp_path / "model"
    model = tiny_qwen2()
    patch = torch.randn(2, 3, 2, 2, 2)
    model.register_buffer("patch", patch.clone())  # persistent: saved beside the weights
    model.save_pretrained(folder)
    quantize_to_gguf(folder, tmp_path / "q.gguf", "decoder-llm", model)
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    field = reader.get_field("comfy.gguf.orig_shape.patch")
    assert field.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert [int(field.parts[i][0]) for i in field.data] == [2, 3, 2, 2, 2]
    assert [list(t.shape) for t in reader.tensors if t.name == "patch"] == [[24, 2]]  # GGUF order: 2 rows of 24
    with streamwise.skeleton():
        loaded = tiny_qwen2()
    loaded.register_buffer("patch", torch.zeros(2, 3, 2, 2, 2))
    streamwise.load(loaded, tmp_path / "q.gguf", "decoder-llm", progress=False)
    assert torch.equal(loaded.patch, patch)


def test_quantized_blocks_stored_in_another_shape_are_expanded_and_reshaped_or_refused_when_it_lies(tmp_path):
    """ComfyUI-GGUF's converter regroups some weights as rows of 256 (`comfy.gguf.orig_shape`): such blocks are
    dequantized into the model's shape, with the reason in the load report; a recorded shape of another element count
    is refused naming the key."""
    torch.manual_seed(0)
    source = tiny_qwen2()
    name = "model.layers.0.mlp.down_proj.weight"  # 64 x 128: rows of 128 values, regrouped as rows of 256
    weight = source.state_dict()[name]

    def write(path, shape):
        writer = gguf.GGUFWriter(path, arch="streamwise")
        for key, tensor in source.state_dict().items():
            if key == name:
                writer.add_array(f"comfy.gguf.orig_shape.{key}", shape)
                blocks = gguf.quants.quantize(tensor.reshape(-1, 256).numpy(), gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(key, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(key, tensor.numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write(tmp_path / "regrouped.gguf", [64, 128])
    with streamwise.skeleton():
        loaded = tiny_qwen2()
    report = streamwise.load(loaded, tmp_path / "regrouped.gguf", "decoder-llm", progress=False)
    assert (loaded.state_dict()[name] - weight).abs().max() < 0.01  # Q8_0's error, in the model's shape
    assert "stored as [32, 256], its shape is [64, 128]" in report.dequantized_tensors[name]
    write(tmp_path / "lying.gguf", [64, 64])
    with streamwise.skeleton():
        loaded = tiny_qwen2()
    with pytest.raises(CheckpointError, match=r"metadata `comfy.gguf.orig_shape.model.layers.0.mlp.down_proj.weight`:"
                                              r" .* is no shape of the 8192 elements"):
        streamwise.load(loaded, tmp_path / "lying.gguf", "decoder-llm", progress=False)
