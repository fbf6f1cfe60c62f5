"""streamwise.load: real files written by the real libraries, in place, atomic on every failure."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import struct

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamwise
from streamwise.runtime.builders.model_spec import ModelSpecError
from streamwise.runtime.checkpoint import comfy_quant
from streamwise.runtime.checkpoint.readers import CheckpointError
from streamwise.runtime.cli.streamwise import main as streamwise_main
from streamwise.runtime.quant import k_quants
from streamwise.runtime.sizes import human
from streamwise.schemas.vocabulary import GGUF_WRITE_TYPES

from helpers import gguf_policy, make_policy, tiny_qwen2, write_policy

IDS = torch.tensor([[3, 17, 99, 5, 64, 2]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen2 saved by transformers (config.json + model.safetensors), and its logits."""
    torch.manual_seed(0)
    model = tiny_qwen2()
    folder = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(folder)
    with torch.no_grad():
        return folder, model, model(IDS).logits


def skeleton_model(**overrides):
    with streamwise.skeleton():
        return tiny_qwen2(**overrides)


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def fingerprint(model):
    return [
        (name, type(m), sorted(m.__dict__), [(n, id(t)) for n, t in m._parameters.items()])
        for name, m in model.named_modules()
    ]


def test_skeleton_puts_parameters_on_meta_and_keeps_buffers():
    model = skeleton_model()
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta


def test_safetensors_load_is_exact_and_converts_the_tree(saved):
    folder, _, expected = saved
    model = skeleton_model()
    report = streamwise.load(model, folder / "model.safetensors", "decoder-llm")
    assert report.tensors == 27 and report.residents == {} and report.dequantized == 0
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(logits(model), expected)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "StreamedLinear"


def test_a_stranding_plan_is_refused_before_anything_is_read_when_asked(saved, tmp_path):
    folder, _, expected = saved
    linears_only = write_policy(tmp_path, "linears", '\n[[stream.rule]]\nid = "linear"\nkind = "linear"\n'
                                'select = { class = "Linear" }\n')
    model = skeleton_model()
    before = fingerprint(model)
    with pytest.raises(streamwise.PolicyError, match=r"^error\[stranded-tensors\]: policy `linears` on "
                                                     r"`Qwen2ForCausalLM`: \d+ tensors .* allow_stranded") as refused:
        streamwise.load(model, folder / "model.safetensors", linears_only, allow_stranded=False)
    assert '[[stream.rule]] kind = "auto", select = { class = "Embedding" }' in str(refused.value)
    assert fingerprint(model) == before and all(p.is_meta for p in model.parameters())  # nothing read
    report = streamwise.load(model, folder / "model.safetensors", linears_only)  # the library's default: accepted
    tensors = [(type(m), t) for m in model.modules() for t in [*m._parameters.values(), *m._buffers.values()]
               if t is not None]
    left = sum(t.nbytes for cls, t in tensors if not issubclass(cls, torch.nn.Linear))  # all but the Linears'
    share = math.floor(10_000 * (1 - left / sum(t.nbytes for _, t in tensors))) / 100
    assert 0 < share < 100 and report.covered == f"{share:.2f}%" and str(report).endswith(f"; covered {share:.2f}%")
    assert torch.equal(logits(model), expected)
    full = streamwise.load(skeleton_model(), folder / "model.safetensors", "decoder-llm", allow_stranded=False)
    assert full.covered == "100.00%"


def test_sharded_folder_with_an_index(saved, tmp_path):
    _, original, expected = saved
    original.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = skeleton_model()
    streamwise.load(model, tmp_path, "decoder-llm")
    assert torch.equal(logits(model), expected)
    with streamwise.skeleton():
        narrower = tiny_qwen2(intermediate_size=96)
    message = failing_load(narrower, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    assert f"{tmp_path / shard}: tensor `model.layers.0.mlp.up_proj.weight`: shape [128, 64]" in message


def test_quantize_on_load_from_a_float_checkpoint(saved, tmp_path):
    folder, _, expected = saved
    policy = write_policy(tmp_path, "int8", """extends = "decoder-llm"

[quant]
exclude = { path = "lm_head" }

[[quant.rule]]
id = "linears"
select = { class = "Linear" }
format = "convrot_int8"
group_size = 16
""")
    model = skeleton_model()
    report = streamwise.load(model, folder, policy)
    assert report.residents == {"convrot_int8": 14}
    result = logits(model)
    assert (result - expected).norm() / expected.norm() < 0.02


def test_gguf_written_by_streamwise_quantize_loads_as_residents(saved, tmp_path, capsys):
    folder, _, expected = saved
    policy = gguf_policy(tmp_path, "Q8_0")
    target = tmp_path / "model.gguf"
    assert streamwise_main(["quantize", str(folder), str(target), "--policy", str(policy)]) == 0
    assert "Q8_0 x15" in capsys.readouterr().out
    resident = skeleton_model()
    report = streamwise.load(resident, target, policy, arithmetic="float32")  # the stored weights, exactly
    assert report.residents == {"gguf": 15}
    assert report.bytes == sum(int(t.n_bytes) for t in gguf.GGUFReader(target).tensors)  # raw blocks counted too
    assert resident.model.layers[0].self_attn.q_proj._parameters["weight"].dtype == torch.uint8
    assert report.quantized == {f"{n}.weight": "Q8_0" for n, m in resident.named_modules()
                                if isinstance(m, torch.nn.Linear)}
    assert streamwise.load(skeleton_model(), target, "decoder-llm").residents == {"gguf": 15}  # its own gguf rule
    dequantized_once = skeleton_model()  # a `none` rule: the quantized tensors dequantize at load, each with why
    float_report = streamwise.load(dequantized_once, target, make_policy(
        stream={"rule": [{"id": "s", "kind": "auto", "select": {"holds": "parameters"}}]},
        quant={"rule": [{"id": "keep-float", "select": {"class": "Linear"}, "format": "none"}]}))
    assert float_report.dequantized == 15 and float_report.quantized == {}
    assert all("Q8_0" in why and "`keep-float` gives this layer `none`" in why
               for why in float_report.dequantized_tensors.values())
    assert torch.equal(logits(resident), logits(dequantized_once))
    assert (logits(resident) - expected).norm() / expected.norm() < 0.02


def test_comfy_quant_round_trip(saved, tmp_path):
    folder, _, _ = saved
    policy = make_policy(
        stream={"rule": [{"id": "l", "kind": "linear", "select": {"class": "Linear"}}]},
        quant={"rule": [
            {"id": "q", "select": {"path": "model.layers.*.mlp.*"}, "format": "convrot_int8", "group_size": 16},
        ]},
    )
    quantized = skeleton_model()
    streamwise.load(quantized, folder, streamwise.load_policy("decoder-llm").model_copy(update={"quant": policy.quant}))
    path = tmp_path / "int8.safetensors"
    safetensors.torch.save_file(comfy_quant.state_dict(quantized), path)
    meta = safetensors.torch.load_file(path)["model.layers.0.mlp.up_proj.comfy_quant"]
    assert json.loads(bytes(meta.tolist())) == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16}
    reloaded = skeleton_model()
    report = streamwise.load(reloaded, path, "decoder-llm")
    assert report.residents == {"convrot_int8": 6}
    assert torch.equal(logits(reloaded), logits(quantized))


def test_load_pretrained_builds_picks_the_policy_and_loads(saved):
    folder, _, expected = saved
    model, report, chosen = streamwise.load_pretrained(folder)
    assert chosen == "`auto` picked `decoder-llm` by root class `Qwen2ForCausalLM`"
    assert report.tensors == 27 and report.file == str(folder / "model.safetensors")
    assert torch.equal(logits(model), expected)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "StreamedLinear"


def test_load_pretrained_takes_the_file_dtype_unless_told(saved, tmp_path):
    folder, original, _ = saved
    copy.deepcopy(original).to(torch.bfloat16).save_pretrained(tmp_path)
    model, _, chosen = streamwise.load_pretrained(tmp_path / "model.safetensors", "decoder-llm")
    assert chosen == "policy `decoder-llm`"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # built in bf16, not cast to it
    model, _, _ = streamwise.load_pretrained(folder, "decoder-llm", dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_dtype_conversion_is_explicit(saved):
    folder, _, expected = saved
    model = skeleton_model().to(torch.bfloat16)
    with pytest.raises(CheckpointError, match="dtype torch.float32 in the file, torch.bfloat16 in the model"):
        streamwise.load(model, folder, "decoder-llm")
    streamwise.load(model, folder, "decoder-llm", dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16


def failing_load(model, path, policy="decoder-llm"):
    before = fingerprint(model)
    with pytest.raises(CheckpointError) as raised:
        streamwise.load(model, path, policy)
    assert fingerprint(model) == before  # nothing assigned, nothing converted
    return "\n".join(raised.value.problems)  # every problem (the message summarizes those alike)


def test_missing_extra_and_misshapen_tensors_are_all_named(saved, tmp_path):
    folder, original, _ = saved
    tensors = {k: v.contiguous() for k, v in original.state_dict().items()}
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(2)
    path = tmp_path / "broken.safetensors"
    safetensors.torch.save_file(tensors, path)
    message = failing_load(skeleton_model(), path)
    assert f"{path}: tensor `model.norm.weight`: missing from the file" in message
    assert "tensor `model.layers.0.mlp.gate_proj.weight`: shape [3, 3] in the file, [128, 64] in the model" in message
    assert "tensor `vision_tower.patch_embed.weight`: not in the model (an extra tensor)" in message


def test_unknown_comfy_quant_format_is_refused(saved, tmp_path):
    folder, original, _ = saved
    tensors = {k: v.contiguous() for k, v in original.state_dict().items()}
    tensors["lm_head.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    path = tmp_path / "fp8.safetensors"
    safetensors.torch.save_file(tensors, path)
    assert "comfy_quant format `float8_e4m3fn` is not one Streamwise reads" in failing_load(skeleton_model(), path)


def test_unsupported_gguf_type_names_the_tensor(saved, tmp_path):
    folder, original, _ = saved
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    for name, tensor in original.state_dict().items():
        if name == "lm_head.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((128, 64 // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    message = failing_load(skeleton_model(), path)
    assert "tensor `lm_head.weight`" in message and "Q8_1" in message


def test_gguf_residents_of_an_unsupported_type_are_refused_before_anything_changes(tmp_path):
    qtype = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    path = tmp_path / "resident.gguf"
    writer = gguf.GGUFWriter(str(path), arch="test")
    writer.add_tensor("proj.weight", np.zeros((16, 32 // block * size), dtype=np.uint8), raw_dtype=qtype)
    writer.add_tensor("proj.bias", np.zeros(16, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    policy = make_policy(stream={"rule": [{"id": "l", "kind": "linear", "select": {"class": "Linear"}}]},
                         quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "gguf"}]})
    with streamwise.skeleton():
        model = torch.nn.Sequential()
        model.add_module("proj", torch.nn.Linear(32, 16))
    message = failing_load(model, path, policy)
    assert "tensor `proj.weight`" in message and qtype.name in message


@pytest.mark.parametrize("failure, raised", [
    (MemoryError("out of memory"), "ConversionError"), (KeyboardInterrupt(), "KeyboardInterrupt"),
])
def test_a_failure_after_the_assignments_puts_everything_back(saved, tmp_path, monkeypatch, failure, raised):
    """Quantizing on load runs after the tensors are placed; running out of memory (or Ctrl-C) there undoes them,
    and an interrupt stays an interrupt."""
    from streamwise.runtime.convert import ConversionError
    from streamwise.runtime.quant.formats import FORMATS

    folder, _, _ = saved
    policy = streamwise.load_policy("decoder-llm").model_copy(update={"quant": make_policy(
        quant={"rule": [{"id": "q", "select": {"path": "model.layers.1.mlp.*"}, "format": "int8"}]}).quant})
    calls = []

    def failing(weight, group_size):
        calls.append(1)
        raise failure

    monkeypatch.setattr(FORMATS["int8"], "quantize", failing)
    model = skeleton_model()
    before = fingerprint(model)
    with pytest.raises(BaseException) as caught:
        streamwise.load(model, folder, policy)
    assert type(caught.value).__name__ == raised
    assert not isinstance(caught.value, ConversionError) or "out of memory" in str(caught.value)
    assert calls and fingerprint(model) == before
    assert all(p.is_meta for p in model.parameters())


def test_a_tied_partner_stored_as_a_comfy_quant_layer_unties(saved, tmp_path):
    torch.manual_seed(0)
    tied = tiny_qwen2(tie_word_embeddings=True)
    policy = streamwise.load_policy("decoder-llm").model_copy(update={"quant": make_policy(
        quant={"rule": [{"id": "q", "select": {"path": "lm_head"}, "format": "int8"}]}).quant})
    tied_folder = tmp_path / "tied"
    tied.save_pretrained(tied_folder)
    quantized = skeleton_model(tie_word_embeddings=True)
    streamwise.load(quantized, tied_folder, policy)
    path = tmp_path / "tied-int8.safetensors"
    tensors = comfy_quant.state_dict(quantized)
    safetensors.torch.save_file(tensors, path)
    reloaded = skeleton_model(tie_word_embeddings=True)
    assert streamwise.load(reloaded, path, "decoder-llm").residents == {"int8": 1}
    assert torch.equal(logits(reloaded), logits(quantized))
    del tensors["model.embed_tokens.weight"]
    safetensors.torch.save_file(tensors, path)
    message = failing_load(skeleton_model(tie_word_embeddings=True), path)
    assert "tensor `model.embed_tokens.weight`: missing from the file" in message


def test_a_tied_weight_stored_twice_must_agree(tmp_path):
    torch.manual_seed(0)
    tied = tiny_qwen2(tie_word_embeddings=True)
    tensors = {k: v.contiguous() for k, v in tied.state_dict().items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    path = tmp_path / "twice.safetensors"
    safetensors.torch.save_file(tensors, path)
    model = skeleton_model(tie_word_embeddings=True)
    streamwise.load(model, path, "decoder-llm")  # equal copies: fine, and still tied
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    safetensors.torch.save_file(tensors, path)
    message = failing_load(skeleton_model(tie_word_embeddings=True), path)
    assert (
        "tensor `lm_head.weight`: tied to `model.embed_tokens.weight` in the model, "
        "but the file stores a different value"
    ) in message


def test_each_tensor_comes_from_the_shard_the_index_names(saved, tmp_path):
    _, original, _ = saved
    tensors = {k: v.contiguous() for k, v in original.state_dict().items()}
    safetensors.torch.save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, tmp_path / "a.safetensors")
    safetensors.torch.save_file(
        {"lm_head.weight": tensors["lm_head.weight"], "model.norm.weight": torch.full((64,), 42.0),
         "stray": torch.zeros(1)},
        tmp_path / "b.safetensors",
    )
    weight_map = {k: "a.safetensors" for k in tensors} | {"lm_head.weight": "b.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    message = failing_load(skeleton_model(), tmp_path)
    assert message == f"{tmp_path / 'b.safetensors'}: tensor `stray` is not listed in the index"
    safetensors.torch.save_file(
        {"lm_head.weight": tensors["lm_head.weight"], "model.norm.weight": torch.full((64,), 42.0)},
        tmp_path / "b.safetensors",
    )
    model = skeleton_model()
    streamwise.load(model, tmp_path, "decoder-llm")
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])  # a.safetensors's, as the index says


@pytest.mark.parametrize("weight_map, reason", [
    ({"lm_head.weight": 1}, "must map tensor names to shard file names"),
    ([], "must map tensor names to shard file names"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
], ids=["number-shard", "list", "deeply-nested"])
def test_malformed_shard_indexes_are_named(tmp_path, weight_map, reason):
    text = weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map})
    (tmp_path / "model.safetensors.index.json").write_text(text)
    message = failing_load(skeleton_model(), tmp_path)
    assert message.startswith(f"{tmp_path / 'model.safetensors.index.json'}: not a shard index") and reason in message


def test_a_deeply_nested_safetensors_header_is_named(tmp_path):
    header = b"[" * 200_000 + b"]" * 200_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert f"{path}: not a readable safetensors file" in failing_load(skeleton_model(), path)


def write_gguf(path, tensors: dict, quantized: dict | None = None):
    quantized = quantized or {}
    writer = gguf.GGUFWriter(str(path), arch="test")
    for name, tensor in tensors.items():
        if name in quantized:
            blocks = gguf.quants.quantize(tensor.float().numpy(), quantized[name])
            writer.add_tensor(name, blocks, raw_dtype=quantized[name])
        else:
            writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def test_a_quantized_tensor_for_an_integer_buffer_is_refused(tmp_path):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(32, dtype=torch.int64))

    path = tmp_path / "steps.gguf"
    write_gguf(path, {"steps": torch.linspace(0, 100.7, 32)}, {"steps": gguf.GGMLQuantizationType.Q8_0})
    with streamwise.skeleton():
        model = Counter()
    message = failing_load(model, path, make_policy())
    assert "tensor `steps`: a quantized Q8_0 tensor in the file, torch.int64 in the model" in message


@pytest.mark.parametrize("gguf_type", ["F16", "BF16"])
def test_half_precision_gguf_weights_load_back_as_residents(saved, tmp_path, gguf_type):
    folder, original, expected = saved
    policy = gguf_policy(tmp_path, gguf_type)
    target = tmp_path / "half.gguf"
    assert streamwise_main(["quantize", str(folder), str(target), "--policy", str(policy)]) == 0
    model = skeleton_model()
    assert streamwise.load(model, target, policy).residents == {"gguf": 15}
    layer = model.model.layers[0].self_attn.q_proj
    stored = layer._parameters["weight"]
    assert stored.dtype == torch.uint8 and stored.numel() == 2 * 64 * 64  # the file's 16-bit storage
    half = getattr(torch, {"F16": "float16", "BF16": "bfloat16"}[gguf_type])
    assert torch.equal(layer(torch.ones(1, 64)), torch.nn.functional.linear(
        torch.ones(1, 64), original.model.layers[0].self_attn.q_proj.weight.to(half).float(), layer.bias))
    assert (logits(model) - expected).norm() / expected.norm() < 0.02


@pytest.mark.parametrize("damage", ["truncate", "header", "empty", "junk"])
def test_corrupt_safetensors_files(saved, tmp_path, damage):
    folder, _, _ = saved
    data = (folder / "model.safetensors").read_bytes()
    data = {
        "truncate": data[: len(data) // 2],
        "header": data[:8] + b"{not json" + data[17:],
        "empty": b"",
        "junk": struct.pack("<Q", 2**40) + b"x" * 100,
    }[damage]
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(data)
    assert str(path) in failing_load(skeleton_model(), path)


def test_truncated_gguf(saved, tmp_path, capsys):
    folder, _, _ = saved
    target = tmp_path / "model.gguf"
    streamwise_main(["quantize", str(folder), str(target), "--policy", "decoder-llm"])
    damaged = tmp_path / "truncated.gguf"
    damaged.write_bytes(target.read_bytes()[:5000])
    assert f"{damaged}: not a readable GGUF file" in failing_load(skeleton_model(), damaged)


@pytest.fixture(scope="module")
def small_files(tmp_path_factory, saved):
    folder, _, _ = saved
    target = tmp_path_factory.mktemp("gguf") / "model.gguf"
    streamwise_main(["quantize", str(folder), str(target), "--policy", "decoder-llm"])
    return {"safetensors": (folder / "model.safetensors").read_bytes(), "gguf": target.read_bytes()}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(["safetensors", "gguf"]),
    cuts=st.lists(st.tuples(st.integers(0, 2**20), st.binary(max_size=16)), min_size=1, max_size=4),
)
def test_mutated_files_give_clean_errors(small_files, tmp_path, kind, cuts):
    data = bytearray(small_files[kind])
    for offset, patch in cuts:
        offset %= len(data)
        data[offset : offset + len(patch)] = patch
    path = tmp_path / f"mutated.{kind}"
    path.write_bytes(bytes(data))
    model = skeleton_model()
    before = fingerprint(model)
    try:
        streamwise.load(model, path, "decoder-llm")
    except CheckpointError:
        assert fingerprint(model) == before


def test_a_failed_quantize_leaves_an_existing_destination_alone(tmp_path):
    from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf

    model = torch.nn.Linear(32, 16)
    tensors = {"weight": model.weight.detach().to(torch.float8_e4m3fn), "bias": model.bias.detach()}
    safetensors.torch.save_file(tensors, tmp_path / "fp8.safetensors")
    destination = tmp_path / "out.gguf"
    destination.write_bytes(b"an earlier result")
    with pytest.raises(CheckpointError, match="GGUF cannot store torch.float8_e4m3fn"):
        quantize_to_gguf(tmp_path / "fp8.safetensors", destination, make_policy(), model)
    assert destination.read_bytes() == b"an earlier result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8.safetensors", "out.gguf"]


def test_quantize_keeps_bf16_and_integer_tensors_loadable(tmp_path):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 16)
            self.register_buffer("steps", torch.tensor([7, 70000], dtype=torch.int64))

    torch.manual_seed(0)
    source = Tiny().to(torch.bfloat16)
    with torch.no_grad():
        source.proj.bias.fill_(70000.0)  # beyond float16's range: must not be forced to F16
    tensors = {k: v.contiguous() for k, v in source.state_dict().items()}
    safetensors.torch.save_file(tensors, tmp_path / "tiny.safetensors")
    policy = make_policy(stream={"rule": [{"id": "l", "kind": "linear", "select": {"class": "Linear"}}]},
                         quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "gguf"}]})
    from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf

    report = quantize_to_gguf(tmp_path / "tiny.safetensors", tmp_path / "tiny.gguf", policy, Tiny())
    assert report.types == {"BF16": 1, "Q8_0": 1, "int64": 1}
    with streamwise.skeleton():
        target = Tiny().to(torch.bfloat16)
    streamwise.load(target, tmp_path / "tiny.gguf", policy)
    assert torch.equal(target.steps, source.steps) and torch.equal(target.proj.bias, source.proj.bias)


def test_a_gguf_source_keeps_its_blocks_or_is_requantized(saved, tmp_path):
    folder, _, _ = saved
    q8 = gguf_policy(tmp_path, "Q8_0")
    first, second = tmp_path / "q8.gguf", tmp_path / "again.gguf"
    assert streamwise_main(["quantize", str(folder), str(first), "--policy", str(q8), "--layout", "streamwise"]) == 0
    spec = ["--model", "transformers:Qwen2ForCausalLM", "--model-config", (folder / "config.json").read_text()]
    assert streamwise_main(["quantize", str(first), str(second), "--policy", "decoder-llm", *spec]) == 0

    def blocks(path):
        return {t.name: (t.tensor_type, t.data.tobytes()) for t in gguf.GGUFReader(path).tensors}

    assert blocks(second) == blocks(first)  # no rule asks for another type: the Q8_0 blocks are copied as they are
    q4 = gguf_policy(tmp_path, "Q4_0")
    third = tmp_path / "q4.gguf"
    assert streamwise_main(["quantize", str(first), str(third), "--policy", str(q4), *spec]) == 0
    model = skeleton_model()
    assert streamwise.load(model, third, q4).residents == {"gguf": 15}
    assert model.model.layers[0].mlp.up_proj.gguf_qtype == gguf.GGMLQuantizationType.Q4_0


def test_quantize_output_takes_the_umask_or_the_replaced_files_mode(saved, tmp_path):
    import os

    folder, _, _ = saved
    previous = os.umask(0o022)
    try:
        fresh, kept = tmp_path / "fresh.gguf", tmp_path / "kept.gguf"
        kept.write_bytes(b"an earlier result")
        kept.chmod(0o640)
        for target in (fresh, kept):
            assert streamwise_main(["quantize", str(folder), str(target), "--policy", "decoder-llm"]) == 0
    finally:
        os.umask(previous)
    assert (fresh.stat().st_mode & 0o777, kept.stat().st_mode & 0o777) == (0o644, 0o640)


def test_quantize_finds_the_config_beside_a_weight_file(saved, tmp_path):
    folder, _, _ = saved
    target = tmp_path / "from-file.gguf"
    assert streamwise_main(["quantize", str(folder / "model.safetensors"), str(target), "--policy", "decoder-llm"]) == 0
    assert streamwise.load(skeleton_model(), target, "decoder-llm").tensors == 27


@pytest.mark.parametrize("destination", ["model.safetensors", "folder.gguf", "missing/out.gguf", "same"])
def test_quantize_refuses_destinations_it_would_damage(saved, tmp_path, capsys, destination):
    folder, _, _ = saved
    source = tmp_path / "source.gguf"
    assert streamwise_main(["quantize", str(folder), str(source), "--policy", "decoder-llm"]) == 0
    (tmp_path / "folder.gguf").mkdir()
    target = source if destination == "same" else tmp_path / destination
    spec = ["--model", "transformers:Qwen2ForCausalLM", "--model-config", (folder / "config.json").read_text()]
    before = source.read_bytes()
    capsys.readouterr()
    assert streamwise_main(["quantize", str(source), str(target), "--policy", "decoder-llm", *spec]) == 1
    assert capsys.readouterr().err.startswith(f"streamwise quantize: {target}: ")
    assert source.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.gguf", "source.gguf"]


@pytest.mark.parametrize("group", [None, [16], 0, True, "16"])
def test_comfy_quant_group_sizes_must_be_positive_integers(saved, tmp_path, group):
    folder, original, _ = saved
    tensors = {k: v.contiguous() for k, v in original.state_dict().items()}
    q, scale = streamwise.runtime.quant.int8.quantize_int8(tensors["lm_head.weight"], 16)
    header = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}).encode()
    tensors |= {"lm_head.weight": q, "lm_head.weight_scale": scale,
                "lm_head.comfy_quant": torch.tensor(list(header), dtype=torch.uint8)}
    path = tmp_path / "groups.safetensors"
    safetensors.torch.save_file(tensors, path)
    assert f"`convrot_groupsize` must be a positive integer, got {group!r}" in failing_load(skeleton_model(), path)


def test_load_pretrained_builds_in_the_dtype_most_values_are_stored_in(saved, tmp_path):
    _, original, _ = saved
    tensors = {
        k: v.to(torch.bfloat16 if v.ndim == 2 else torch.float32).contiguous() for k, v in original.state_dict().items()
    }
    original.config.save_pretrained(tmp_path)
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    model, _, _ = streamwise.load_pretrained(tmp_path, "decoder-llm")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # float32 norms do not decide
    safetensors.torch.save_file({k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in tensors.items()},
                                tmp_path / "model.safetensors")
    model, _, _ = streamwise.load_pretrained(tmp_path, "decoder-llm")
    assert model.lm_head.weight.dtype == torch.bfloat16  # float8 storage computes in bf16
    with pytest.raises(ModelSpecError, match="cannot build a model in torch.float8_e4m3fn"):
        streamwise.load_pretrained(tmp_path, "decoder-llm", dtype=torch.float8_e4m3fn)


def test_load_pretrained_names_a_config_transformers_rejects(saved, tmp_path):
    folder, _, _ = saved
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_size": "64"}))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ModelSpecError, match=f"cannot read {tmp_path}/config.json"):
        streamwise.load_pretrained(tmp_path, "decoder-llm")


def test_loading_tells_what_it_did_in_one_line_each_and_the_bar_can_be_turned_off(tmp_path, caplog, monkeypatch):
    import logging

    import tqdm

    tiny_qwen2().save_pretrained(tmp_path)
    monkeypatch.setattr(tqdm, "tqdm", lambda *args, **kwargs: pytest.fail("progress=False shows no bar"))
    with caplog.at_level(logging.INFO, logger="streamwise"):
        model, report, chosen = streamwise.load_pretrained(tmp_path, progress=False)
    assert report.built == "Qwen2ForCausalLM (config.architectures)"
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("streamwise.load", f"load_pretrained: {tmp_path.name}: built {report.built}; {chosen}"),
        ("streamwise.load", f"load: policy `decoder-llm`, {dataclasses.replace(report, built=None)}"),
    ]
    read = f"{report.tensors} tensors ({human(report.bytes)}) from model.safetensors"
    assert str(report) == f"built {report.built}; {read}; covered 100.00%"


def test_a_gguf_load_report_says_what_stayed_quantized_and_why_the_rest_did_not(tmp_path):
    model = tiny_qwen2()
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.gguf"
    streamwise_main(["quantize", str(tmp_path), str(path), "--policy", "decoder-llm"])
    report = streamwise.load_pretrained(path, "decoder-llm", progress=False).report
    kept = f"{len(report.quantized)} kept quantized (Q8_0 x{len(report.quantized)})"
    assert report.quantized and kept in str(report) and f"residents gguf x{len(report.quantized)}" in str(report)


WRITTEN_QUANTIZED = [t for t in GGUF_WRITE_TYPES if t not in ("F32", "F16", "BF16")]


def test_the_writable_types_are_every_type_the_gguf_package_quantizes_and_the_k_quants():
    def quantizes(qtype):
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.quantize(np.ones((2, 256 * block if block > 256 else 256), np.float32), qtype)
        except NotImplementedError:
            return False
        return True

    assert set(GGUF_WRITE_TYPES) == {t.name for t in gguf.GGMLQuantizationType if quantizes(t)} | {
        t.name for t in k_quants.QUANTIZERS}


@pytest.mark.parametrize("gguf_type", WRITTEN_QUANTIZED)
def test_quantize_with_one_type_and_no_policy_loads_back_bit_exact_as_residents(tmp_path, gguf_type):
    torch.manual_seed(0)
    wide = dict(hidden_size=256, intermediate_size=256)  # rows that fill the 256-value blocks of TQ1_0/TQ2_0
    tiny_qwen2(**wide).save_pretrained(tmp_path / "src")
    target = tmp_path / f"model.{gguf_type}.gguf"
    assert streamwise_main(["quantize", str(tmp_path / "src"), str(target), "--type", gguf_type]) == 0
    model = skeleton_model(**wide)
    report = streamwise.load(model, target, "decoder-llm", progress=False, arithmetic="float32")  # exactly
    assert set(report.quantized.values()) == {gguf_type} and len(report.quantized) == 15  # every Linear
    (stored,) = [t for t in gguf.GGUFReader(target).tensors if t.name == "blk.0.ffn_down.weight"]  # llama.cpp's
    weight = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(256, 256).copy())
    x = torch.randn(3, 256)
    assert torch.equal(model.model.layers[0].mlp.down_proj(x), torch.nn.functional.linear(x, weight))


def test_quantize_says_which_weight_matrices_stay_float_and_why(saved, tmp_path, capsys):
    folder, _, _ = saved
    policy = write_policy(tmp_path, "mixed", '''extends = "decoder-llm"

[quant]
exclude = { path = "model.layers.0.self_attn.q_proj" }

[[quant.rule]]
id = "small-stays"
select = { path = "model.layers.0.mlp.*" }
format = "gguf"
min_weights = 1000000

[[quant.rule]]
id = "keep"
select = { path = "model.layers.1.mlp.up_proj" }
format = "none"
''')
    target = tmp_path / "mixed.gguf"
    assert streamwise_main(["quantize", str(folder), str(target), "--policy", str(policy), "--type", "Q4_0"]) == 0
    err = capsys.readouterr().err
    why = dict(line.strip().split(": ", 1) for line in err.splitlines()[1:])
    assert err.startswith(f"warning: {len(why)} weight matrices stay float:")
    assert why["model.embed_tokens.weight"] == "no gguf quant rule selects it"
    assert why["model.layers.0.self_attn.q_proj.weight"] == "[quant] exclude selects it"
    assert why["model.layers.0.mlp.up_proj.weight"] == ("it has fewer than the 1000000 weights quant rule "
                                                        "`small-stays` asks for")
    assert why["model.layers.1.mlp.up_proj.weight"] == "quant rule `keep` keeps it float"
    assert "model.layers.1.mlp.down_proj.weight" not in why  # the shipped gguf-linears rule, as Q4_0


def test_rows_that_do_not_fill_whole_blocks_are_named(saved, tmp_path, capsys):
    folder, _, _ = saved  # rows of 64 values; TQ2_0 blocks hold 256
    assert streamwise_main(["quantize", str(folder), str(tmp_path / "t.gguf"), "--type", "TQ2_0"]) == 0
    assert ("model.layers.0.self_attn.q_proj.weight: its rows of 64 values do not fill whole TQ2_0 blocks of 256"
            in capsys.readouterr().err)
