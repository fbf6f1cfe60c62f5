"""Hostile model descriptions: a llama.cpp GGUF's metadata lying about its model, folders that need their own code,
and JSON options on the command line. Each is a clear error naming the file and field (or the option) before anything
is built, read from stdin or run.

The GGUF cases start from a file written by llama.cpp's converter layout (`tests/llama_cpp_files.py`, the gguf
package's writer) and rewrite its metadata with the gguf package's own writer, tensors copied as they are.
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

import streamwise
from streamwise.runtime.builders import model_spec
from streamwise.runtime.builders.model_spec import ModelSpecError
from streamwise.runtime.checkpoint import CheckpointError, load_tokenizer
from streamwise.runtime.cli import policy_validate
from streamwise.runtime.cli import streamwise as streamwise_cli

from helpers import REPO, leases_here, tiny_qwen2
from llama_cpp_files import float_model, train_tokenizer_parts, write_llama_cpp_gguf

INT32, UINT32, UINT64, STRING = (gguf.GGUFValueType.INT32, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64,
                                 gguf.GGUFValueType.STRING)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """A 2-layer Llama in llama.cpp's layout, Q8_0."""
    parts = train_tokenizer_parts()
    path = tmp_path_factory.mktemp("llama") / "model.gguf"
    write_llama_cpp_gguf(float_model("llama", len(parts[0]), parts[2]), path, "llama", gguf.GGMLQuantizationType.Q8_0,
                         parts)
    return path


def with_metadata(source, target, changes: dict) -> None:
    """`source` written again by the gguf package's writer, with `changes` (key -> (type, value)) to its metadata."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target), arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for key, (kind, value) in changes.items():
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def test_the_rewritten_file_still_loads(llama_gguf, tmp_path):
    path = tmp_path / "same.gguf"
    with_metadata(llama_gguf, path, {})
    assert streamwise.load_pretrained(path, "auto", progress=False).model.config.num_hidden_layers == 2


@pytest.mark.parametrize("changes, says", [
    ({"llama.block_count": (UINT32, 100)}, "metadata `llama.block_count` claims 100 layers, but the file's tensors "
                                           "hold layers 0, 1"),
    ({"llama.block_count": (UINT32, 2000)}, "claims 2000 layers"),
    ({"llama.block_count": (UINT32, 0)}, "metadata `llama.block_count` is 0; it must be at least 1"),
    ({"llama.attention.key_length": (UINT64, 2**40)}, "metadata `llama.attention.key_length` is 1099511627776, larger "
                                                      "than any dimension of the file's tensors"),
    ({"llama.attention.key_length": (STRING, "16")}, "metadata `llama.attention.key_length`: STRING, where llama.cpp "
                                                     "writes an integer"),
    ({"llama.embedding_length": (INT32, -64)}, "metadata `llama.embedding_length` is -64; it must be at least 1"),
    ({"llama.attention.head_count": (UINT32, 0)}, "metadata `llama.attention.head_count` is 0"),
], ids=["100-layers", "2000-layers", "no-layers", "key-length-2**40", "string-key-length", "negative-hidden-size",
        "no-heads"])
def test_a_model_shape_the_tensors_do_not_have_is_refused_before_anything_is_built(llama_gguf, tmp_path, monkeypatch,
                                                                                    changes, says):
    path = tmp_path / "lying.gguf"
    with_metadata(llama_gguf, path, changes)
    built = []
    monkeypatch.setattr(model_spec, "building_in", lambda dtype: built.append(dtype))  # any build would fail here
    with pytest.raises(CheckpointError) as raised:
        streamwise.load_pretrained(path, "auto", progress=False)
    assert str(path) in str(raised.value) and says in str(raised.value), str(raised.value)
    assert built == []


def test_an_architecture_that_is_not_utf8_is_a_checkpoint_error_naming_the_field(llama_gguf, tmp_path):
    path = tmp_path / "bytes.gguf"
    data = bytearray(llama_gguf.read_bytes())
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    assert data[at:at + 5] == b"llama"
    data[at:at + 5] = b"ll\xffma"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="metadata `general.architecture`: not UTF-8"):
        streamwise.load_pretrained(path, "auto", progress=False)


# --- no remote code, no prompt ------------------------------------------------------------------------------------

def remote_code_folder(folder, marker) -> None:
    """A folder as the Hub serves a model with its own code: config.json's auto_map names configuration_x.py, whose
    import would write `marker`."""
    tiny_qwen2().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="made_up_model", auto_map={"AutoConfig": "configuration_x.XConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_x.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import PretrainedConfig\n"
        "class XConfig(PretrainedConfig):\n    model_type = 'made_up_model'\n")


def test_a_folder_that_needs_its_own_code_is_refused_naming_the_entry_and_never_asks(tmp_path, monkeypatch):
    remote_code_folder(tmp_path, tmp_path / "ran")
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("something asked on stdin"))
    with pytest.raises(ModelSpecError) as raised:
        streamwise.load_pretrained(tmp_path)
    message = str(raised.value)
    assert "`auto_map` maps `AutoConfig` to `configuration_x.XConfig`" in message and "made_up_model" in message
    assert "trust_remote_code=False" in message and not (tmp_path / "ran").exists()


def test_quantize_on_such_a_folder_answers_yes_to_nothing(tmp_path):
    """transformers would prompt "[y/N]" on stdin (a ComfyUI server blocks on it) and run the code on `y`."""
    remote_code_folder(tmp_path, tmp_path / "ran")
    result = subprocess.run([sys.executable, "-m", "streamwise.runtime.cli.streamwise", "quantize", str(tmp_path),
                             str(tmp_path / "out.gguf")], input="y\ny\n", capture_output=True, text=True, timeout=300,
                            cwd=REPO)
    assert result.returncode == 1 and "auto_map" in result.stderr and "Traceback" not in result.stderr
    assert "[y/N]" not in result.stdout + result.stderr and not (tmp_path / "ran").exists()


def test_a_tokenizer_of_its_own_code_is_refused_naming_the_entry(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "XTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    with pytest.raises(ModelSpecError, match="maps `AutoTokenizer` to `tokenization_x.XTokenizer`"):
        load_tokenizer(tmp_path)


def test_every_transformers_entry_point_is_told_not_to_trust_remote_code(tmp_path, monkeypatch):
    """The config, the GGUF config and both tokenizer routes hand transformers trust_remote_code=False."""
    seen = []

    def record(real):
        def call(*args, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", record(transformers.AutoConfig.from_pretrained))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        record(transformers.AutoTokenizer.from_pretrained))
    tiny_qwen2().save_pretrained(tmp_path)
    model_spec.read_config(tmp_path)
    assert seen and all(flag is False for flag in seen)


# --- JSON options on the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "--model-config: 200000 characters of JSON; the limit is 65536"),
    ("[" * 1000 + "]" * 1000, "JSON nested more than 32 levels deep"),
    ('{"num_hidden_layers": ' + "9" * 4400 + "}", "a number of 4400 characters; the limit is 64"),
    ('{"x": NaN}', "`NaN` is not JSON"),
], ids=["huge", "deep", "4400-digits", "nan"])
def test_json_options_are_bounded_usage_errors(capsys, text, says):
    assert policy_validate.main(["--model", "transformers:qwen2", "--model-config", text, "decoder-llm"]) == 2
    assert says in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        streamwise_cli.main(["quantize", "a.safetensors", "b.gguf", "--model", "transformers:qwen2",
                             "--model-config", text])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "Traceback" not in err


def test_the_bound_json_option_still_reads_a_config(capsys):
    assert policy_validate.main(["--model", "transformers:qwen2", "--model-config",
                                 '{"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2}',
                                 "decoder-llm"]) in (0, 1)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("lease", [False, True], ids=["copied", "leased"])
def test_a_loaded_tensor_views_the_file_only_while_a_lease_holds_it(llama_gguf, tmp_path, monkeypatch, lease):
    """Without a lease the weights are the process's own memory from the start (`checked_file`); with one they are
    the file's page cache (`leased`) until someone opens the file to write, and then the process's own memory,
    with the same values, before the writer gets it."""
    if lease and not leases_here(tmp_path):
        pytest.skip(f"no read lease on {tmp_path}'s file system here")
    monkeypatch.setenv("STREAMWISE_LEASE", "1" if lease else "0")
    path = tmp_path / "fresh.gguf"  # a copy no other test's gguf reader has mapped
    path.write_bytes(llama_gguf.read_bytes())
    model = streamwise.load_pretrained(path, "auto", progress=False).model

    def mapped() -> bool:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return str(path) in maps.read()

    assert mapped() == lease
    assert all(isinstance(t, torch.Tensor) for t in model.state_dict().values())
    before = model(torch.arange(4).reshape(1, 4)).logits.detach()
    with open(path, "r+b") as handle:  # a writer: the kernel holds it until the lease is given back
        handle.write(bytes(64))
        assert not mapped()
    assert torch.equal(model(torch.arange(4).reshape(1, 4)).logits.detach(), before)
    assert np.isfinite(before.numpy()).all()
