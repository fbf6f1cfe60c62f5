"""GGUF files as people download them: written in llama.cpp's converter layout (`llama_cpp_files`), loaded from
the `.gguf` alone, with no config.json beside it. The loaded model must equal the float model after the same
quantize -> dequantize round trip, logits and greedy tokens: loaded in the float32 arithmetic, which computes with
exactly the weights the file holds (the CPU's int8 default rounds the activations too: `test_cpu_matmul.py`).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

import streamwise
from streamwise.runtime.checkpoint import CheckpointError, load_tokenizer
from streamwise.runtime.convert import applied_state

from llama_cpp_files import CORPUS, FAMILIES, MORE, float_model, train_tokenizer_parts, write_gguf, write_llama_cpp_gguf


def assert_same_logits(model, expected, ids):
    """The loaded model computes what the float model the file was written from computes, to float32 rounding."""
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tokenizer_parts():
    return train_tokenizer_parts()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MORE])
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0],
                         ids=["Q8_0", "Q4_0"])
def test_llama_cpp_gguf_alone_loads_quantized_and_matches(tmp_path, tokenizer_parts, family, qtype):
    tokens, _, eos = tokenizer_parts
    path = tmp_path / f"tiny-{family}.{qtype.name}.gguf"
    expected = write_llama_cpp_gguf(float_model(family, len(tokens), eos), path, family, qtype, tokenizer_parts)
    assert not (tmp_path / "config.json").exists()
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.attn_q.weight" in names and "output_norm.weight" in names

    # float32 arithmetic: the weights the file holds, exactly (the int8 default is checked below)
    model, report, chosen = streamwise.load_pretrained(path, "auto", arithmetic="float32")

    assert type(model).__name__ == type(expected).__name__
    tied = {"lm_head"} if model.config.tie_word_embeddings else set()  # shares the embedding's float values
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - tied
    assert report.residents == {"gguf": len(linears)}  # every Linear weight stays in its blocks
    assert set(report.quantized) == {f"{n}.weight" for n in linears}
    assert set(report.quantized.values()) == {qtype.name}
    assert model.model.layers[0].self_attn.q_proj._parameters["weight"].dtype == torch.uint8  # its blocks
    assert list(report.dequantized_tensors) == ["model.embed_tokens.weight"]  # an Embedding computes in float
    why = report.dequantized_tensors["model.embed_tokens.weight"]
    assert "Q8_0" in why and "Embedding" in why and ("lm_head.weight" in why) == bool(tied)
    assert report.dequantized == 1 and report.ignored == {}

    ids = torch.tensor([[eos, 5, 17, 42, 99, 7]])
    assert_same_logits(model, expected, ids)
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=eos)
    assert torch.equal(model.generate(ids, **greedy), expected.generate(ids, **greedy))
    fast, fast_report, _ = streamwise.load_pretrained(path, "auto")  # llama.cpp's arithmetic on the CPU
    assert fast_report.cpu_arithmetic == {qtype.name: "int8"}
    with torch.no_grad():
        got, want = fast(ids).logits, expected(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 2e-2

    # the tokenizer comes from the file's metadata, through what load_pretrained records
    source = applied_state(model).source
    assert source == str(path)
    tokenizer = load_tokenizer(source)
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    text = CORPUS[0]
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


def test_auto_policies_carry_a_gguf_rule(tmp_path, tokenizer_parts):
    """`auto` picks decoder-llm for Llama and the generic transformers policy for Qwen3: both keep GGUF blocks."""
    tokens, _, eos = tokenizer_parts
    picked = {}
    for family in ("llama", "qwen3"):
        path = tmp_path / f"{family}.gguf"
        write_llama_cpp_gguf(float_model(family, len(tokens), eos), path, family, gguf.GGMLQuantizationType.Q8_0,
                             tokenizer_parts)
        _, report, chosen = streamwise.load_pretrained(path, "auto")
        picked[family] = chosen
        assert report.residents["gguf"] >= 14
    assert "decoder-llm" in picked["llama"] and "transformers" in picked["qwen3"]


def test_a_quant_rule_other_than_gguf_is_the_reason_given(tmp_path, tokenizer_parts):
    tokens, _, eos = tokenizer_parts
    path = tmp_path / "llama.gguf"
    write_llama_cpp_gguf(float_model("llama", len(tokens), eos), path, "llama", gguf.GGMLQuantizationType.Q8_0,
                         tokenizer_parts)
    policy = streamwise.load_policy("decoder-llm")
    rules = [r.model_copy(update={"format": "none"}) if r.id == "gguf-linears" else r for r in policy.quant.rule]
    policy = policy.model_copy(update={"quant": policy.quant.model_copy(update={"rule": rules})})
    _, report, _ = streamwise.load_pretrained(path, policy)
    assert report.residents == {} and report.quantized == {}
    why = report.dequantized_tensors["model.layers.0.self_attn.q_proj.weight"]
    assert "Q8_0" in why and "`gguf-linears`" in why and "`none`" in why


def test_an_architecture_transformers_cannot_map_is_a_clear_error(tmp_path):
    path = tmp_path / "rwkv.gguf"
    write_gguf(path, "rwkv6", {"token_embd.weight": np.zeros((8, 32), dtype=np.float32)}, {"rwkv6.block_count": 1})
    with pytest.raises(CheckpointError) as caught:
        streamwise.load_pretrained(path, "auto")
    text = str(caught.value)
    assert str(path) in text and "`rwkv6`" in text and "llama" in text and "qwen3" in text and "gemma2" in text


def test_a_llama_cpp_file_into_a_model_built_elsewhere_maps_too(tmp_path, tokenizer_parts):
    """`streamwise.load` into a skeleton the caller built: the llama.cpp names map onto its keys."""
    tokens, _, eos = tokenizer_parts
    path = tmp_path / "qwen3.gguf"
    source = float_model("qwen3", len(tokens), eos)
    expected = write_llama_cpp_gguf(source, path, "qwen3", gguf.GGMLQuantizationType.Q8_0, tokenizer_parts)
    with streamwise.skeleton():
        model = transformers.AutoModelForCausalLM.from_config(source.config).eval()
    report = streamwise.load(model, path, "transformers", arithmetic="float32")
    assert report.residents == {"gguf": 14}
    ids = torch.tensor([[1, 2, 3, 4]])
    assert_same_logits(model, expected, ids)


def test_a_folder_holding_only_the_gguf_loads_and_extra_tensors_are_reported(tmp_path, tokenizer_parts):
    """The folder form; a tensor transformers maps to no parameter (llama3's `rope_freqs`) is listed as ignored."""
    tokens, _, eos = tokenizer_parts
    path = tmp_path / "llama.gguf"
    source = float_model("llama", len(tokens), eos)
    rope_freqs = {"rope_freqs.weight": np.ones(source.config.head_dim // 2, dtype=np.float32)}
    expected = write_llama_cpp_gguf(source, path, "llama", gguf.GGMLQuantizationType.Q8_0, tokenizer_parts, rope_freqs)
    model, report, _ = streamwise.load_pretrained(tmp_path, "auto", arithmetic="float32")
    assert list(report.ignored) == ["rope_freqs.weight"] and "no parameter" in report.ignored["rope_freqs.weight"]
    ids = torch.tensor([[1, 2, 3]])
    assert_same_logits(model, expected, ids)


def test_a_config_json_beside_wins_and_a_mismatch_leaves_the_skeleton_untouched(tmp_path, tokenizer_parts):
    tokens, _, eos = tokenizer_parts
    path = tmp_path / "gemma2.gguf"
    source = float_model("gemma2", len(tokens), eos)
    expected = write_llama_cpp_gguf(source, path, "gemma2", gguf.GGMLQuantizationType.Q8_0, tokenizer_parts)
    source.config.save_pretrained(tmp_path)
    model, report, _ = streamwise.load_pretrained(path, "auto", arithmetic="float32")
    assert applied_state(model).source == str(tmp_path) and report.residents == {"gguf": 14}
    ids = torch.tensor([[1, 2, 3]])
    assert_same_logits(model, expected, ids)

    wider = source.config.to_dict() | {"intermediate_size": 256}
    with streamwise.skeleton():
        other = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**wider)).eval()
    before = {n: (p.device, p.dtype) for n, p in other.named_parameters()}
    with pytest.raises(CheckpointError) as caught:
        streamwise.load(other, path, "transformers")
    assert f"{path}: tensor `model.layers.0.mlp.up_proj.weight`: shape [128, 64] in the file" in "\n".join(
        caught.value.problems)  # every problem is kept; the message names it among the tensors alike
    assert {n: (p.device, p.dtype) for n, p in other.named_parameters()} == before
    assert all(p.is_meta for p in other.parameters()) and applied_state(other) is None


@pytest.mark.parametrize("family", list(MORE))
def test_more_architectures_load_from_the_gguf_alone(tmp_path, tokenizer_parts, family):
    tokens, _, eos = tokenizer_parts
    path = tmp_path / f"{family}.gguf"
    expected = write_llama_cpp_gguf(float_model(family, len(tokens), eos), path, family,
                                    gguf.GGMLQuantizationType.Q4_0, tokenizer_parts)
    model, report, _ = streamwise.load_pretrained(path, "auto", arithmetic="float32")
    assert type(model).__name__ == type(expected).__name__
    assert report.residents["gguf"] == len(report.quantized) > 0
    assert set(report.quantized.values()) == {"Q4_0"}
    ids = torch.tensor([[eos, 5, 17, 42]])
    assert_same_logits(model, expected, ids)


def test_a_gguf_without_an_architecture_and_without_a_config_is_a_clear_error(tmp_path):
    path = tmp_path / "anonymous.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)  # the writer always adds it; a hand-made file may not
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="no `general.architecture`"):
        streamwise.load_pretrained(path, "auto")
