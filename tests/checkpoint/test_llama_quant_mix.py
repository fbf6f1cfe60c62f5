"""llama-quantize's Q4_K_M and Q5_K_M per-tensor type choices, against the types llama-quantize itself gave each
tensor of five tiny models (`tests/fixtures/llama_quantize/types.json`, made by `make_reference.py` with a build
from llama.cpp's source): a dense 16-layer Llama, a tied Qwen2, rows that fill no 256-value block, an 8-expert
Mixtral and a Qwen2-MoE with shared experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamwise.runtime.checkpoint.llama_quant_mix import MIXES, mix_types, quantized

TABLE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "llama_quantize" / "types.json").read_text())


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("model", list(TABLE))
def test_each_tensor_takes_the_type_llama_quantize_gives_it(model, mix):
    entry = TABLE[model]
    shapes = {name: tuple(shape) for name, shape, _ in entry["tensors"]}
    chosen = mix_types(mix, shapes, architecture=entry["architecture"], layers=entry["layers"],
                       experts=entry["experts"])
    given = entry[mix]
    assert {name: kind.name for name, kind in chosen.items()} == {name: given[name] for name in chosen}
    kept = {name: stored for name, _, stored in entry["tensors"] if name not in chosen}
    assert kept == {name: given[name] for name in kept}  # what it does not quantize keeps its type
    assert len(chosen) > len(kept) // 2 and len(set(chosen.values())) >= 2  # a mix, not one type


def test_the_fixtures_cover_each_rule():
    types = {kind for entry in TABLE.values() for mix in MIXES for kind in entry[mix].values()}
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1"} <= types
    assert not quantized("blk.0.attn_norm.weight", (256, 256)) and not quantized("blk.0.ffn_gate_inp.weight", (8, 256))


@pytest.mark.parametrize("mix", list(MIXES))
def test_streamwise_quantize_writes_the_mix_llama_quantize_makes_and_it_loads(tmp_path, mix):
    """The tied Qwen2 of the table, saved by transformers and quantized by `streamwise quantize --type Q4_K_M`: every
    tensor llama-quantize quantizes takes its type (named by the model's keys, matched through llama.cpp's names);
    the file loads alone and computes within the mix's error of the float model."""
    import gguf
    import torch
    import transformers

    import streamwise
    from streamwise.runtime.checkpoint.llama_cpp_layout import llama_cpp_tensors
    from streamwise.runtime.cli.streamwise import main as streamwise_main

    entry = TABLE["qwen2-tied"]
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=8, tie_word_embeddings=True,
                                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "float")
    target = tmp_path / f"model.{mix}.gguf"
    assert streamwise_main(["quantize", str(tmp_path / "float"), str(target), "--type", mix, "--layout",
                            "streamwise"]) == 0  # the state-dict names (llama.cpp's layout: test_llama_cpp_layout)

    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(target).tensors}
    names = {tensor.key: tensor.name for tensor in llama_cpp_tensors(model)[1]}
    quantized_by_llama = {name: kind for name, kind in entry[mix].items() if kind not in ("F32", "F16")}
    assert {names[key]: kind for key, kind in written.items() if names.get(key) in quantized_by_llama} \
        == quantized_by_llama

    loaded, report, _ = streamwise.load_pretrained(target, "auto", arithmetic="float32")  # the file's weights, exactly
    assert {"Q6_K", mix[:4]} <= set(report.quantized.values())
    rounded = transformers.Qwen2ForCausalLM(config).eval()  # the float model after gguf's own dequantizer
    rounded.load_state_dict({t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        [int(d) for d in reversed(t.shape)]).copy()) for t in gguf.GGUFReader(target).tensors}, strict=False)
    rounded.tie_weights()
    ids = torch.tensor([[1, 5, 17, 42, 99, 7]])
    with torch.no_grad():
        got, expected, float_logits = loaded(ids).logits, rounded(ids).logits, model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a random 8-layer model compounds each layer's rounding: Q4_K_M 17% off, Q5_K_M 8%
    assert ((got - float_logits).norm() / float_logits.norm()).item() < (0.25 if mix == "Q4_K_M" else 0.12)


REQUANTIZED = ["llama", "qwen2", "qwen3_moe", "mamba"]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("family", REQUANTIZED)
def test_a_llama_cpp_file_requantized_equals_what_llama_quantize_writes(tmp_path, family, mix):
    """The F16 file llama.cpp's converter wrote, requantized by `streamwise quantize --type Q4_K_M`: the same tensors
    in the same order, byte for byte, and the same metadata (tokenizer included) as llama-quantize's own output
    (`tests/fixtures/llama_quantize/<family>.<mix>.gguf`); it loads and computes within the mix's error of the float
    model it was converted from. (llama.cpp's `llama-simple` ran such a file; see `make_reference.py`.)"""
    import gguf
    import numpy as np
    import torch
    import transformers

    import streamwise
    from streamwise.runtime.cli.streamwise import main as streamwise_main

    target = tmp_path / f"{family}.{mix}.gguf"
    assert streamwise_main(["quantize", str(FIXTURES / "llama_cpp_converter" / f"{family}.f16.gguf"), str(target),
                            "--type", mix]) == 0
    ours, theirs = gguf.GGUFReader(target), gguf.GGUFReader(FIXTURES / "llama_quantize" / f"{family}.{mix}.gguf")
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert np.array_equal(np.asarray(mine.data).view(np.uint8), np.asarray(reference.data).view(np.uint8))

    def fields(reader):
        return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}

    assert fields(ours) == fields(theirs)

    folder = FIXTURES / "llama_cpp_converter" / family
    (name,) = json.loads((folder / "config.json").read_text())["architectures"]
    float_model = getattr(transformers, name).from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 17, 42, 33, 7]])
    for path in (target, FIXTURES / "llama_quantize" / f"{family}.{mix}.gguf"):  # ours, and llama-quantize's own
        model, _, _ = streamwise.load_pretrained(path, "auto")
        with torch.no_grad():
            got, expected = model(ids).logits.float(), float_model(ids).logits
        assert ((got - expected).norm() / expected.norm()).item() < 0.1
