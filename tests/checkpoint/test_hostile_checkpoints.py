"""Corrupt and hostile checkpoints: refused before any tensor is placed, as strictly as the formats' libraries.

Every corrupt file is made from a valid one written by the real library (safetensors.torch.save_file,
gguf.GGUFWriter), then damaged in its header. Each must be a `CheckpointError` naming the file, the tensor
and the reason; the library must refuse it too, or the test says why our rule is stricter; and the model
must be exactly as it was.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import struct

import gguf
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import streamwise
from streamwise.runtime.builders.model_spec import ModelSpecError, auto_model
from streamwise.runtime.checkpoint import limits, readers
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
from streamwise.runtime.checkpoint.readers import CheckpointError, open_checkpoint

from helpers import make_policy

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 32)
        self.norm = nn.LayerNorm(32, bias=False)
        self.head = nn.Linear(32, 8, bias=False)


def tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def values() -> dict[str, torch.Tensor]:
    return {name: torch.randn(tuple(t.shape)) for name, t in tiny().state_dict().items()}


def snapshot(model: nn.Module) -> list:
    return [(name, type(m), [(n, id(t), t.clone()) for n, t in m.state_dict(keep_vars=True).items()])
            for name, m in model.named_modules()]


def unchanged(model: nn.Module, before: list) -> bool:
    after = snapshot(model)
    return len(after) == len(before) and all(
        a[:2] == b[:2] and [(n, i) for n, i, _ in a[2]] == [(n, i) for n, i, _ in b[2]]
        and all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(a[2], b[2], strict=True))
        for a, b in zip(after, before, strict=True)
    )


def refused(path, *fragments) -> str:
    """The CheckpointError `streamwise.load` gives for `path`, checked to name the file and each fragment,
    with the model left exactly as it was."""
    model = tiny()
    before = snapshot(model)
    with pytest.raises(CheckpointError) as raised:
        streamwise.load(model, path, make_policy(), progress=lambda done, total: None)
    message = str(raised.value)
    assert str(path) in message and all(f in message for f in fragments), message
    assert unchanged(model, before)
    return message


# --- safetensors ---------------------------------------------------------------------------------------------------

@pytest.fixture
def valid(tmp_path):
    path = tmp_path / "valid.safetensors"
    safetensors.torch.save_file(values(), path, metadata={"format": "pt"})
    return path


def header_of(path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + size]), data[8 + size:]


def write_header(path, text: str, data: bytes) -> None:
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def library_refuses(path) -> bool:
    try:
        with safetensors.safe_open(path, "pt") as handle:
            for key in handle.keys():
                handle.get_tensor(key)
    except Exception:  # the library's SafetensorError, or an OSError
        return True
    return False


def retyped(key, field, value):
    def change(header):
        header[key][field] = value
        return json.dumps(header)
    return change


def same_offsets(header):  # two Parameters sharing memory: zeroing one would zero the other
    header["head.weight"]["data_offsets"] = header["embed.weight"]["data_offsets"]
    return json.dumps(header)


def duplicate_key(header):  # the last duplicate wins in a plain JSON parse: head would get embed's bytes
    text = json.dumps(header)
    return text[:-1] + ', "head.weight": ' + json.dumps(header["embed.weight"]) + "}"


def shifted(header):
    first = min(header.values(), key=lambda e: e.get("data_offsets", [2**64])[0])
    first["data_offsets"] = [o + 2 for o in first["data_offsets"]]
    return json.dumps(header)


def metadata_list(header):
    header["__metadata__"] = ["format", "pt"]
    return json.dumps(header)


def not_an_object(header):
    return json.dumps(list(header))


def nan_value(header):
    return json.dumps(header)[:-1] + ', "x": NaN}'


def grown(header):
    header["norm.weight"]["shape"] = [33]
    return json.dumps(header)


def named(change, name):
    change.__name__ = name
    return change


SAFETENSORS_CORRUPTIONS = [
    (same_offsets, "tensor `head.weight`", "overlaps `embed.weight`"),
    (duplicate_key, "duplicate key `head.weight`"),
    (shifted, "leaves 2 bytes no tensor claims after the header"),
    (named(retyped("norm.weight", "data_offsets", ["0", "128"]), "string_offsets"), "tensor `norm.weight`",
     'data_offsets must be two non-negative integers, not ["0", "128"]'),
    (named(retyped("norm.weight", "shape", [32.9]), "float_shape"), "tensor `norm.weight`",
     "shape must be a list of non-negative integers, not [32.9]"),
    (named(retyped("head.weight", "shape", [True, True]), "bool_shape"), "tensor `head.weight`", "[true, true]"),
    (named(retyped("head.weight", "data_offsets", [0, 1024.0]), "float_offsets"), "[0, 1024.0]"),
    (named(retyped("head.weight", "data_offsets", [-0, 1024]), "negative_offsets"), "tensor `head.weight`"),
    (named(retyped("head.weight", "dtype", "F31"), "unknown_dtype"), "tensor `head.weight`", 'unknown dtype "F31"'),
    (named(retyped("head.weight", "offsets", [0, 1]), "extra_key"), "exactly the keys dtype, shape and data_offsets"),
    (grown, "tensor `norm.weight`", "F32[33] needs 132"),
    (metadata_list, "`__metadata__` must map strings to strings"),
    (not_an_object, "the header is not a JSON object"),
    (nan_value, "`NaN` is not JSON"),
]


@pytest.mark.parametrize("corruption", SAFETENSORS_CORRUPTIONS, ids=lambda c: c[0].__name__)
def test_corrupt_safetensors_headers_are_refused_before_anything_is_placed(valid, corruption):
    change, *fragments = corruption
    header, data = header_of(valid)
    write_header(valid, change(header), data)
    refused(valid, *fragments)
    # the library refuses each of these too, except a key other than dtype/shape/data_offsets, which it ignores
    assert library_refuses(valid) == (change.__name__ != "extra_key")


@pytest.mark.parametrize("tail", [b"x", b""], ids=["trailing-byte", "truncated"])
def test_the_tensors_must_cover_the_data_exactly(valid, tail):
    header, data = header_of(valid)
    write_header(valid, json.dumps(header), data + tail if tail else data[:-4])
    refused(valid, "the tensors end at data byte")
    assert library_refuses(valid)


def test_stricter_than_the_library_only_on_duplicate_keys_and_unknown_entry_keys(valid):
    """The library keeps the last of two duplicate keys and ignores unknown keys in an entry; a duplicate
    is ambiguous and an unknown key unreadable, so both are refused here. Everything else agrees."""
    header, data = header_of(valid)
    text = json.dumps(header)
    write_header(valid, text[:-1] + ', "norm.weight": ' + json.dumps(header["norm.weight"]) + "}", data)
    assert not library_refuses(valid)
    refused(valid, "duplicate key `norm.weight`")


def test_a_misaligned_tensor_the_library_accepts_still_loads(tmp_path):
    """Back to back, an F16 tensor of odd length puts the next F32 tensor off its alignment: valid."""
    path = tmp_path / "odd.safetensors"
    text = json.dumps({"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},
                       "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})
    write_header(path, text, struct.pack("<e", 1.5) + struct.pack("<f", 2.5))
    assert not library_refuses(path)
    tensors = open_checkpoint(path).tensors
    assert tensors["a"].read().item() == 1.5 and tensors["b"].read().item() == 2.5


def test_header_reads_are_bounded_and_tensors_are_private_copies(valid, monkeypatch):
    """A header claiming more than the file (or the format's 100 MB) is refused after reading its 8-byte
    length alone; a valid file is read for its header only, and each tensor is read on demand, exactly its own
    bytes, into memory of its own: writing into one changes neither the file nor the next read."""
    reads = []
    real_read = readers.CheckedFile.read

    def counting_open(path, mode):
        handle = open(path, mode)
        read = handle.read
        handle.read = lambda n=-1: reads.append(len(chunk := read(n))) or chunk
        return handle

    def counting_read(self, offset, nbytes):
        reads.append(nbytes)
        return real_read(self, offset, nbytes)

    monkeypatch.setattr(readers, "open", counting_open, raising=False)
    monkeypatch.setattr(readers.CheckedFile, "read", counting_read)
    header_size = struct.unpack("<Q", valid.read_bytes()[:8])[0]
    before = valid.read_bytes()
    tensors = open_checkpoint(valid).tensors
    assert sum(reads) == 8 + header_size
    first = tensors["embed.weight"].read()
    assert reads[-1] == first.numel() * first.element_size()
    first.zero_()
    assert not torch.equal(tensors["embed.weight"].read(), first) and valid.read_bytes() == before
    liar = valid.with_name("liar.safetensors")
    liar.write_bytes(struct.pack("<Q", readers.MAX_HEADER + 1) + b"{}" + b" " * 64)
    reads.clear()
    with pytest.raises(CheckpointError, match="header claims 100000001 bytes"):
        open_checkpoint(liar)
    assert reads == [8]


# --- paths ---------------------------------------------------------------------------------------------------------

def test_unusable_paths_are_checkpoint_errors(tmp_path):
    for path in (tmp_path / ("x" * 256 + ".safetensors"), tmp_path / ("d" * 250) / ("e" * 250) / "m.gguf",
                 tmp_path / "nul\0.safetensors", tmp_path / "missing.safetensors"):
        with pytest.raises(CheckpointError) as raised:
            open_checkpoint(path)
        assert repr(str(path)) in str(raised.value) or str(path) in str(raised.value)
    (tmp_path / "holder" / "model.safetensors").mkdir(parents=True)  # a folder where the file should be
    with pytest.raises(CheckpointError, match="model.safetensors: not a regular file"):
        open_checkpoint(tmp_path / "holder")


@pytest.mark.parametrize("shard, reason", [
    ("../outside.safetensors", "is not a file name in the index's folder"),
    ("/etc/passwd", "is not a file name in the index's folder"),
    ("..", "is not a file name in the index's folder"),
    ("a\0b.safetensors", "holds a NUL byte"),
    ("s" * 300 + ".safetensors", "File name too long"),
    ("sub", "not a regular file"),
], ids=["parent", "absolute", "dotdot", "nul", "too-long", "folder"])
def test_shard_names_stay_inside_the_folder(tmp_path, shard, reason):
    (tmp_path / "sub").mkdir()
    safetensors.torch.save_file(values(), tmp_path.parent / "outside.safetensors")
    (tmp_path / readers.SHARD_INDEX).write_text(json.dumps({"weight_map": {"embed.weight": shard}}))
    refused(tmp_path, reason)


def test_fifos_are_refused_without_opening_them(tmp_path):
    """A FIFO named like a checkpoint (alone, in a folder, or as a shard an index lists) would block `open`
    forever; a forked child's timeout keeps a regression from hanging the suite."""
    for folder in ("single", "folder", "sharded"):
        (tmp_path / folder).mkdir()
    os.mkfifo(tmp_path / "single" / "model.safetensors")
    os.mkfifo(tmp_path / "single" / "model.gguf")
    os.mkfifo(tmp_path / "folder" / "model.safetensors")
    os.mkfifo(tmp_path / "sharded" / "shard-1.safetensors")
    (tmp_path / "sharded" / readers.SHARD_INDEX).write_text(json.dumps({"weight_map": {"w": "shard-1.safetensors"}}))
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    paths = [tmp_path / "single" / "model.safetensors", tmp_path / "single" / "model.gguf", tmp_path / "folder",
             tmp_path / "sharded", tmp_path / "model.safetensors.index.json"]
    child = multiprocessing.get_context("fork").Process(target=_refuse_all, args=(paths,))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, f"exit code {child.exitcode}: a FIFO was opened, or blocked the open"


def _refuse_all(paths) -> None:
    """In a forked child (nothing to import again): exit 0 only when every path is refused as not a file."""
    for path in paths:
        try:
            open_checkpoint(path)
        except CheckpointError as exc:
            if "not a regular file" not in str(exc):
                os._exit(2)
        else:
            os._exit(3)
    os._exit(0)


# --- GGUF ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def valid_gguf(tmp_path):
    """embed (Q8_0), norm (F32), head (Q8_0, the last tensor)."""
    path = tmp_path / "valid.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    for name, tensor in values().items():
        if name == "norm.weight":
            writer.add_tensor(name, tensor.numpy())
        else:
            writer.add_tensor(name, gguf.quants.quantize(tensor.numpy(), Q8_0), raw_dtype=Q8_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


def patch_tensor_info(path, name: str, *, type_id: int | None = None, offset: int | None = None) -> None:
    """Overwrite a tensor's type id or data offset in place, where the gguf package's reader found them."""
    entry = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    at = entry.field.offset + sum(part.nbytes for part in entry.field.parts[:4])
    data = bytearray(path.read_bytes())
    if type_id is not None:
        data[at:at + 4] = struct.pack("<I", type_id)
    if offset is not None:
        data[at + 4:at + 12] = struct.pack("<Q", offset)
    path.write_bytes(bytes(data))


def gguf_library_refuses(path) -> bool:
    try:
        gguf.GGUFReader(path)
    except Exception:  # the package signals corruption with many exception types
        return True
    return False


def shift_norm(path, by: int) -> None:
    reader = gguf.GGUFReader(path)
    offset = next(t.data_offset for t in reader.tensors if t.name == "norm.weight") - reader.data_offset
    patch_tensor_info(path, "norm.weight", offset=offset + by)


GGUF_DAMAGE = {  # damage: (how, what the message says, whether the gguf package refuses it too)
    "overlap": (lambda p: patch_tensor_info(p, "norm.weight", offset=0), ["tensor `norm.weight`", "overlaps them"],
                False),
    "misaligned": (lambda p: shift_norm(p, 4), ["tensor `norm.weight`", "not a multiple of general.alignment 32"],
                   False),
    "q8_to_q4": (lambda p: patch_tensor_info(p, "embed.weight", type_id=Q4_0), ["tensor `norm.weight`",
                 "leaves a hole, or a type or shape before it does not match the data"], False),
    "q8_to_q4_last": (lambda p: patch_tensor_info(p, "head.weight", type_id=Q4_0),
                      ["bytes follow the last tensor's padded data"], False),
    "unknown_type": (lambda p: patch_tensor_info(p, "head.weight", type_id=99),
                     ["tensor `head.weight`", "unknown GGML type id 99"], True),
    "partial_blocks": (lambda p: patch_tensor_info(p, "norm.weight", type_id=gguf.GGMLQuantizationType.Q4_K),
                       ["tensor `norm.weight`", "Q4_K rows hold whole blocks of 256 values"], True),
    "past_the_end": (lambda p: p.write_bytes(p.read_bytes()[:-64]),
                     ["tensor `head.weight`", "run past the end of the file"], True),
}


@pytest.mark.parametrize("damage", GGUF_DAMAGE)
def test_corrupt_gguf_layouts_are_refused(valid_gguf, damage):
    """Where the gguf package accepts the damage, the rule is llama.cpp's loader's (each tensor at the
    padded end of the one before) or ours (nothing after the last tensor's padding: a type id changed to
    a smaller one on the last tensor shows only there)."""
    how, fragments, library = GGUF_DAMAGE[damage]
    how(valid_gguf)
    assert gguf_library_refuses(valid_gguf) == library
    refused(valid_gguf, *fragments)


def test_the_valid_files_load(valid, valid_gguf):
    for path in (valid, valid_gguf):
        model = tiny()
        streamwise.load(model, path, make_policy(), progress=lambda done, total: None)
        assert torch.allclose(model.norm.weight, values()["norm.weight"])


def test_a_gguf_array_claiming_more_than_the_file_is_refused_before_its_items_are_read(tmp_path):
    """The package's reader loops over a claimed array length even past the end of the file (reading
    nothing each time: a practical hang); here the claimed length is checked against the bytes that follow
    before any item is read."""
    path = tmp_path / "array.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_array("test.values", [1, 2, 3])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"test.values") + len(b"test.values") + 4 + 4  # after the key, the value type, the item type
    data[at:at + 8] = struct.pack("<Q", 2**62)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="metadata `test.values`: an array of 4611686018427387904 items needs "
                                              "at least 18446744073709551616 bytes; 25 follow"):
        open_checkpoint(path)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_quantize_refuses_corrupt_sources(valid, valid_gguf, tmp_path, source):
    path = valid if source == "safetensors" else valid_gguf
    if source == "safetensors":
        header, data = header_of(path)
        write_header(path, same_offsets(header), data)
    else:
        GGUF_DAMAGE["overlap"][0](path)
    destination = tmp_path / "out.gguf"
    with pytest.raises(CheckpointError, match="overlaps"):
        quantize_to_gguf(path, destination, make_policy(), tiny())
    assert not destination.exists()


# --- config ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int8", "complex64", "float8_e4m3fn"])
def test_a_config_dtype_a_model_cannot_be_built_in_is_named(tmp_path, dtype):
    import transformers

    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=8, dtype=dtype)
    with pytest.raises(ModelSpecError, match=f"`dtype` {dtype} .* not a floating dtype a model can be built in"):
        auto_model(config)
    config.save_pretrained(tmp_path)
    safetensors.torch.save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelSpecError, match=f"`dtype` {dtype}"):
        streamwise.load_pretrained(tmp_path)


# --- mutated headers ---------------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**64 + 1) | st.floats(allow_nan=False) | st.sampled_from(
        ["F32", "F16", "I64", "F4", "x", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "dtype"]), inner, max_size=2),
    max_leaves=4,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(
    st.sampled_from(["embed.weight", "norm.weight", "head.weight", "__metadata__", "extra"]),
    st.sampled_from(["dtype", "shape", "data_offsets", "format", None]),
    JSON_VALUES,
), min_size=1, max_size=3), tail=st.sampled_from([0, 0, 1, -4]))
def test_mutated_headers_are_accepted_only_where_the_library_accepts_them(tmp_path, mutations, tail):
    path = tmp_path / "mutated.safetensors"
    safetensors.torch.save_file(values(), path, metadata={"format": "pt"})
    header, data = header_of(path)
    for key, field, value in mutations:
        if field is None:
            header[key] = value
        elif isinstance(header.get(key), dict):
            header[key][field] = value
    write_header(path, json.dumps(header), data + b"\0" * tail if tail >= 0 else data[:tail])
    try:
        open_checkpoint(path)
    except CheckpointError as exc:
        assert str(path) in str(exc)
    else:
        assert not library_refuses(path)


# --- round 2 (issue #25): linear, bounded headers; names, shapes and claimed model shapes -----------------------

def test_duplicate_keys_in_a_large_header_are_found_in_one_pass(tmp_path, monkeypatch):
    """A 2.3 MB header of 40,000 entries with one duplicate at its end (quadratic before: 52.8 s): refused naming the
    key, each key looked at once."""
    path = tmp_path / "many.safetensors"
    tensors = {f"t{i}": torch.zeros(1) for i in range(40_000)}
    safetensors.torch.save_file(tensors, path)
    header, data = header_of(path)
    text = json.dumps(header)
    write_header(path, text[:-1] + ', "t7": ' + json.dumps(header["t7"]) + "}", data)
    looked, real = [], readers._unique_keys
    monkeypatch.setattr(readers, "_unique_keys", lambda pairs: looked.append(len(pairs)) or real(pairs))
    with pytest.raises(CheckpointError, match="duplicate key `t7`"):
        open_checkpoint(path)
    assert sum(looked) <= 4 * 40_001  # the object and the entries' own small objects, each once


@pytest.mark.parametrize("name, says", [
    ("", "is empty or holds a NUL byte"), ("a\0b", "is empty or holds a NUL byte"),
    ("n" * 5000, f"a name of 5000 bytes; the limit is {readers.limits.MAX_TENSOR_NAME}"),
], ids=["empty", "nul", "5000-characters"])
def test_names_no_library_writes_are_refused(valid, valid_gguf, tmp_path, name, says):
    header, data = header_of(valid)
    header[name] = header.pop("norm.weight")
    write_header(valid, json.dumps(header), data)
    refused(valid, says)
    path = tmp_path / "named.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_tensor(name, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        open_checkpoint(path)


def test_a_zero_element_tensor_with_an_absurd_dimension_is_refused_and_quantize_says_so(valid, tmp_path):
    """[0, 2**64 - 1] holds no byte, so every size check passes; torch cannot make it (it crashed quantize)."""
    header, data = header_of(valid)
    header["empty"] = {"dtype": "F32", "shape": [0, 2**64 - 1], "data_offsets": [len(data), len(data)]}
    write_header(valid, json.dumps(header), data)
    refused(valid, "tensor `empty`", "more elements than 63 bits count")
    with pytest.raises(CheckpointError, match="more elements than 63 bits count"):
        quantize_to_gguf(valid, tmp_path / "out.gguf", make_policy(), tiny())


@pytest.mark.parametrize("dims", [5, 8])
def test_gguf_tensors_of_more_than_four_dimensions_are_refused(tmp_path, dims):
    path = tmp_path / "dims.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_tensor("deep", np.zeros((1,) * (dims - 1) + (32,), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match=f"tensor `deep`: {dims} dimensions; llama.cpp reads at most 4"):
        open_checkpoint(path)


def gguf_with_array(path, count: int) -> None:
    """A file the gguf writer wrote with a 3-string array, grown to `count` one-byte strings (18 MB at 2 M)."""
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_array("test.tokens", ["a", "a", "a"])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"test.tokens") + len(b"test.tokens") + 4 + 4
    data[at:at + 8] = struct.pack("<Q", count)
    end = at + 8 + 3 * 9
    path.write_bytes(bytes(data[:end]) + struct.pack("<Qc", 1, b"a") * (count - 3) + bytes(data[end:]))


def test_more_metadata_strings_than_the_limit_are_refused_after_reading_one_chunk(tmp_path, monkeypatch):
    """Two million took 56 s and 3 GB in the gguf package's reader; here the array's claimed length is held to the
    limit on all metadata items before its first item is read."""
    path = tmp_path / "strings.gguf"
    gguf_with_array(path, limits.MAX_GGUF_ARRAY_ITEMS + 1)
    reads = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "b" in mode:
            read = handle.read
            handle.read = lambda n=-1: reads.append(len(chunk := read(n))) or chunk
        return handle

    monkeypatch.setattr(readers, "open", counting_open, raising=False)
    with pytest.raises(CheckpointError, match=f"the metadata arrays hold more than {limits.MAX_GGUF_ARRAY_ITEMS} "):
        open_checkpoint(path)
    assert sum(reads) <= 2**20  # one chunk of the 38 MB file
    gguf_with_array(path, 1000)
    assert open_checkpoint(path).metadata["test.tokens"].value.count == 1000


def test_a_header_with_gemma_4_sized_vocabulary_arrays_is_read(tmp_path):
    """Gemma 4's tokenizer: 262,144 tokens, scores and types and 514,906 merges, 1,301,398 items together."""
    path = tmp_path / "gemma-4-sized.gguf"
    gguf_with_array(path, 1_301_398)
    assert open_checkpoint(path).metadata["test.tokens"].value.count == 1_301_398


def small_gguf(path, **values) -> bytearray:
    writer = gguf.GGUFWriter(str(path), arch="test")
    for key, value in values.items():
        writer.add_uint32(f"test.{key}", value)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return bytearray(path.read_bytes())


@pytest.mark.parametrize("damage, says", [
    (lambda d: d.__setitem__(slice(16, 24), struct.pack("<Q", 2**40)),
     "it claims 1099511627776 metadata keys; the limit is 65536"),
    (lambda d: d.__setitem__(slice(16, 24), struct.pack("<Q", 1000)), "it claims 1000 metadata keys, which need"),
    (lambda d: d.__setitem__(slice(d.index(b"test.b"), d.index(b"test.b") + 6), b"test.a"),
     "metadata key `test.a` appears twice"),
    (lambda d: d.__setitem__(slice(d.index(b"test.a") - 8, d.index(b"test.a")), struct.pack("<Q", 2**50)),
     "a metadata key: a string of 1125899906842624 bytes; the limit is 65535"),
    (lambda d: d.__setitem__(slice(d.index(b"test.a") + 6, d.index(b"test.a") + 10), struct.pack("<I", 99)),
     "metadata `test.a`: unknown value type id 99"),
], ids=["key-count-over-limit", "key-count-over-file", "duplicate-key", "key-length", "value-type"])
def test_gguf_metadata_counts_and_keys_are_checked_before_use(tmp_path, damage, says):
    path = tmp_path / "meta.gguf"
    data = small_gguf(path, a=1, b=2)
    damage(data)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(says)):
        open_checkpoint(path)


def test_many_tensors_with_one_problem_are_one_line_with_a_count(tmp_path):
    """A file cut in half: every tensor past the cut runs past the end, and the message says so once."""
    from streamwise.runtime.cli.example_models import write_example_models

    models = tmp_path / "models"
    (path,) = [p for p in write_example_models(models) if p.suffix == ".gguf"]
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as raised:
        streamwise.load_pretrained(path, progress=False)
    error = raised.value
    assert len(error.problems) > 10  # every tensor is still there to read
    (line,) = str(error).splitlines()
    assert line.startswith(f"{path}: not a readable GGUF file: tensor `blk.")
    assert re.search(rf"run past the end of the file \({len(error.problems) - 1} more tensors alike: `blk\.[^`]+`, "
                     rf"`blk\.[^`]+`, `blk\.[^`]+` and {len(error.problems) - 4} more\)$", line), line


def test_different_problems_stay_apart_and_the_message_is_bounded():
    problems = [f"f.safetensors: tensor `t{i}`: missing from the file" for i in range(500)]
    problems += ["f.safetensors: tensor `w`: shape [2] in the file, [3] in the model", "f.safetensors: bad index"]
    lines = str(CheckpointError(problems)).splitlines()
    assert lines == ["f.safetensors: tensor `t0`: missing from the file (499 more tensors alike: `t1`, `t2`, `t3` and "
                     "496 more)", "f.safetensors: tensor `w`: shape [2] in the file, [3] in the model",
                     "f.safetensors: bad index"]


# --- the safetensors reader at its edges (found by mutation testing) ----------------------------------------------

def _write(path, tensors: dict) -> str:
    safetensors.torch.save_file(tensors, str(path))
    return str(path)


def _raw(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


@pytest.mark.parametrize("name", sorted(readers.SAFETENSORS_DTYPES))
def test_every_dtype_torch_holds_reads_back_bit_for_bit_empty_too(tmp_path, name):
    dtype = readers.SAFETENSORS_DTYPES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(0)
    stored = torch.randint(0, 256, (3 * 5 * itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        stored = stored % 2
    tensors = {"x": stored.view(dtype).reshape(3, 5), "empty": torch.empty((0, 4), dtype=dtype)}
    path = _write(tmp_path / "one.safetensors", tensors)
    read = {t.name: t.read() for t in open_checkpoint(path).tensors.values()}
    assert read["x"].dtype == dtype and torch.equal(read["x"].view(torch.uint8), tensors["x"].view(torch.uint8))
    assert read["empty"].shape == (0, 4) and read["empty"].dtype == dtype


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX sockets")
def test_a_socket_is_no_checkpoint(tmp_path):
    import socket

    path = tmp_path / "model.safetensors"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(path))
        with pytest.raises(CheckpointError, match="not a regular file"):
            open_checkpoint(str(path))


@pytest.mark.parametrize("size", range(8))
def test_a_file_shorter_than_the_header_size_field_is_truncated_before_its_header(tmp_path, size):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\0" * size)
    with pytest.raises(CheckpointError, match="truncated before its header"):
        open_checkpoint(str(path))


def test_a_header_of_size_zero_is_no_json_not_a_truncated_file(tmp_path):
    path = tmp_path / "empty-header.safetensors"
    path.write_bytes(struct.pack("<Q", 0))
    with pytest.raises(CheckpointError, match="its header is not JSON the format allows"):
        open_checkpoint(str(path))


def test_a_tensor_whose_offsets_hold_more_bytes_than_it_needs_is_refused(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(_raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8))
    with pytest.raises(CheckpointError, match=r"data_offsets \[0, 8\] hold 8 bytes, but F32\[1\] needs 4"):
        open_checkpoint(str(path))


def test_a_header_of_many_tensors_is_no_duplicate(tmp_path):
    path = _write(tmp_path / "many.safetensors", {f"t{i}": torch.zeros(1) for i in range(300)})
    assert len(open_checkpoint(path).tensors) == 300


def test_problems_past_a_hundred_are_not_listed_one_by_one(tmp_path):
    header = {f"t{i}": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]} for i in range(150)}
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_raw(header, b"\0" * 4))
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(str(path))
    assert len(raised.value.problems) == 101


@pytest.mark.parametrize("size, shown", [(80, "k" * 80), (81, "k" * 77 + "...")])
def test_a_long_name_is_clipped_past_80_characters(tmp_path, size, shown):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_raw({"k" * size: {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(str(path))
    assert f"tensor `{shown}`:" in raised.value.problems[0]


def test_a_tensor_read_from_the_shard_its_index_names(tmp_path):
    _write(tmp_path / "a.safetensors", {"x": torch.zeros(2), "y": torch.ones(2)})
    _write(tmp_path / "b.safetensors", {"x": torch.full((2,), 7.0)})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "b.safetensors", "y": "a.safetensors"}}))
    read = {t.name: t.read() for t in open_checkpoint(str(index)).tensors.values()}
    assert torch.equal(read["x"], torch.full((2,), 7.0)) and torch.equal(read["y"], torch.ones(2))


def test_a_one_byte_tensor_reads_its_byte(tmp_path):
    path = _write(tmp_path / "byte.safetensors", {"b": torch.tensor([7], dtype=torch.uint8)})
    assert open_checkpoint(path).tensors["b"].read().tolist() == [7]


def _refusal(tmp_path, header: dict, data: bytes) -> str:
    path = tmp_path / "edge.safetensors"
    path.write_bytes(_raw(header, data))
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(str(path))
    return raised.value.problems[0].split(": ", 1)[1]


@pytest.mark.parametrize("entry, data, said", [
    ({"dtype": "U8", "shape": [1], "data_offsets": [0, 2**64]}, b"\0",
     "data_offsets must be two non-negative integers, not [0, 18446744073709551616]"),
    ({"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}, b"\0",
     "shape must be a list of non-negative integers, not [-1]"),
    ({"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}, b"\0" * 3,  # 24 bits: sized, then not read
     "dtype F6_E2M3 has no torch dtype Streamwise reads"),
    ({"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}, b"\0", "dtype F4 has no torch dtype Streamwise reads"),
], ids=["offset-2**64", "negative-size", "six-bit", "four-bit"])
def test_sizes_and_offsets_at_the_formats_edges(tmp_path, entry, data, said):
    assert _refusal(tmp_path, {"x": entry}, data) == f"tensor `x`: {said}"


def test_metadata_that_is_no_string_map_is_shown_clipped_at_60_characters(tmp_path):
    x = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
    assert _refusal(tmp_path, {"__metadata__": {"k": 1}, "x": x}, b"\0") == (
        '`__metadata__` must map strings to strings, not {"k": 1}')
    long = {"k": "v" * 10, "n": list(range(30))}
    assert _refusal(tmp_path, {"__metadata__": long, "x": x}, b"\0").endswith(
        'not {"k": "vvvvvvvvvv", "n": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1...')


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt"])
def test_a_file_of_another_format_is_named_as_such(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"not a checkpoint Streamwise reads \(.safetensors, a shard index"):
        open_checkpoint(str(path))


def test_an_index_whose_weight_map_is_no_map_is_no_shard_index(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": []}))
    with pytest.raises(CheckpointError, match="not a shard index .*`weight_map` must map tensor names"):
        open_checkpoint(str(index))


def test_an_index_at_its_limits(tmp_path, monkeypatch):
    _write(tmp_path / "a.safetensors", {"x": torch.zeros(1)})
    _write(tmp_path / "b.safetensors", {"y": torch.zeros(1)})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    monkeypatch.setattr(limits, "MAX_SHARDS", 2)
    monkeypatch.setattr(limits, "MAX_INDEX_BYTES", index.stat().st_size)
    assert sorted(open_checkpoint(str(index)).tensors) == ["x", "y"]  # exactly at both limits
    monkeypatch.setattr(limits, "MAX_SHARDS", 1)
    with pytest.raises(CheckpointError, match="names 2 shard files; the limit is 1"):
        open_checkpoint(str(index))
    monkeypatch.setattr(limits, "MAX_SHARDS", 2)
    monkeypatch.setattr(limits, "MAX_INDEX_BYTES", index.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="a shard index over"):
        open_checkpoint(str(index))


@pytest.mark.parametrize("pad, clipped", [(43, False), (44, True)])  # 60 and 61 characters of JSON
def test_metadata_of_60_characters_is_shown_whole_and_61_clipped(tmp_path, pad, clipped):
    metadata = {"k": 1, "v": "v" * pad}
    text = json.dumps(metadata)
    said = _refusal(tmp_path, {"__metadata__": metadata, "x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
                    b"\0")
    assert said.endswith(f"not {text[:57]}..." if clipped else f"not {text}")
