"""GGUF files as people download them: written in llama.cpp's converter layout, loaded from the `.gguf` alone.

Each file is written by the gguf package's own `GGUFWriter` with its own name map (`get_tensor_name_map`),
after the transforms llama.cpp's `convert_hf_to_gguf.py` applies (Q/K rotary permutation for Llama, norm + 1
for Gemma), quantized with `gguf.quants.quantize` the way llama.cpp quantizes (2-D weights in blocks, 1-D
tensors in F32), with a byte-level BPE tokenizer in its metadata and no config.json beside it. The loaded
model must equal the float model after the same quantize -> dequantize round trip, logits and greedy tokens.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

import streamwise
from streamwise.runtime.checkpoint import CheckpointError, load_tokenizer
from streamwise.runtime.engine import applied_state

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, streaming weights", "a tiny model says hi"]
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def tokenizer_parts():
    """A byte-level BPE trained here (offline): tokens by id, merges, and the id of its one control token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, tokens.index("<|endoftext|>")


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): Q/K rows into its rotary layout."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# model_type -> (transformers config class, gguf architecture, converter's transform of one (name, array))
def _llama(name, data, config):
    if name.endswith("q_proj.weight"):
        return llama_cpp_permute(data, config.num_attention_heads, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return llama_cpp_permute(data, config.num_attention_heads, config.num_key_value_heads)
    return data


def _gemma(name, data, config):
    return data + 1 if name.endswith("norm.weight") else data  # Gemma2Model.modify_tensors: norms stored as w + 1


FAMILIES = {
    "llama": (transformers.LlamaConfig, gguf.MODEL_ARCH.LLAMA, _llama, {"tie_word_embeddings": False}),
    "qwen3": (transformers.Qwen3Config, gguf.MODEL_ARCH.QWEN3, lambda n, d, c: d, {"tie_word_embeddings": True}),
    "gemma2": (transformers.Gemma2Config, gguf.MODEL_ARCH.GEMMA2, _gemma,
               {"tie_word_embeddings": True, "sliding_window": 64}),
}
MORE = {  # further architectures, one quant type each
    "qwen2": (transformers.Qwen2Config, gguf.MODEL_ARCH.QWEN2, lambda n, d, c: d, {"tie_word_embeddings": True}),
    "phi3": (transformers.Phi3Config, gguf.MODEL_ARCH.PHI3, lambda n, d, c: d, {"tie_word_embeddings": False}),
    "gemma3_text": (transformers.Gemma3TextConfig, gguf.MODEL_ARCH.GEMMA3, _gemma,
                    {"tie_word_embeddings": True, "sliding_window": 64}),
}
FAMILIES.update(MORE)


def float_model(family: str, vocab: int, eos: int):
    config_class, _, _, extra = FAMILIES[family]
    config = config_class(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **SIZES, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from 1 so that a missed Gemma offset shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.rand_like(parameter) * 0.5 + (-0.25 if FAMILIES[family][2] is _gemma else 0.75))
    return model


def write_llama_cpp_gguf(model, path, family: str, qtype, tokenizer_parts, extra=None) -> torch.nn.Module:
    """Write `model` as llama.cpp's converter would, quantized to `qtype`; return the float model the file holds
    (each quantized weight after quantize -> dequantize, each transformed float after its round trip)."""
    config = model.config
    _, arch, transform, _ = FAMILIES[family]
    tokens, merges, eos = tokenizer_parts
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention", rope) if isinstance(rope, dict) else rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i == eos else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    reference = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # the converter skips a tied head
        data = transform(name, tensor.numpy(), config).astype(np.float32)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if data.ndim == 2:  # llama.cpp quantizes matrices; the embedding in Q8_0, as its Q4_0 presets keep it
            kind = gguf.GGMLQuantizationType.Q8_0 if gguf_name == "token_embd.weight" else qtype
            blocks = gguf.quants.quantize(data, kind)
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
            stored = gguf.quants.dequantize(blocks, kind)
        else:
            writer.add_tensor(gguf_name, data)
            stored = data
        reference[name] = transform(name, stored, config)  # what the file's values mean in the model's basis
        if transform is _gemma and name.endswith("norm.weight"):
            reference[name] = stored - np.float32(1)  # the offset undone in float32, as transformers undoes it
        if transform is _llama and name.endswith(("q_proj.weight", "k_proj.weight")):
            reference[name] = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype)
    for name, data in (extra or {}).items():  # tensors the converter writes beyond the model's own
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    rounded = float_model(family, config.vocab_size, eos)
    rounded.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in reference.items()},
                            strict=False)
    if config.tie_word_embeddings:
        rounded.tie_weights()
    return rounded


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

    model, report, chosen = streamwise.load_pretrained(path, "auto")

    assert type(model).__name__ == type(expected).__name__
    tied = {"lm_head"} if model.config.tie_word_embeddings else set()  # shares the embedding's float values
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - tied
    assert report.residents == {"gguf": len(linears)}  # every Linear weight stays in its blocks
    assert set(report.quantized) == {f"{n}.weight" for n in linears}
    assert set(report.quantized.values()) == {qtype.name}
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.uint8
    assert list(report.dequantized_tensors) == ["model.embed_tokens.weight"]  # an Embedding computes in float
    why = report.dequantized_tensors["model.embed_tokens.weight"]
    assert "Q8_0" in why and "Embedding" in why and ("lm_head.weight" in why) == bool(tied)
    assert report.dequantized == 1 and report.ignored == {}

    ids = torch.tensor([[eos, 5, 17, 42, 99, 7]])
    with torch.no_grad():
        got, want = model(ids).logits, expected(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=eos)
    assert torch.equal(model.generate(ids, **greedy), expected.generate(ids, **greedy))

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
    writer = gguf.GGUFWriter(path, "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
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
    report = streamwise.load(model, path, "transformers")
    assert report.residents == {"gguf": 14}
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_folder_holding_only_the_gguf_loads_and_extra_tensors_are_reported(tmp_path, tokenizer_parts):
    """The folder form; a tensor transformers maps to no parameter (llama3's `rope_freqs`) is listed as ignored."""
    tokens, _, eos = tokenizer_parts
    path = tmp_path / "llama.gguf"
    source = float_model("llama", len(tokens), eos)
    rope_freqs = {"rope_freqs.weight": np.ones(source.config.head_dim // 2, dtype=np.float32)}
    expected = write_llama_cpp_gguf(source, path, "llama", gguf.GGMLQuantizationType.Q8_0, tokenizer_parts, rope_freqs)
    model, report, _ = streamwise.load_pretrained(tmp_path, "auto")
    assert list(report.ignored) == ["rope_freqs.weight"] and "no parameter" in report.ignored["rope_freqs.weight"]
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_config_json_beside_wins_and_a_mismatch_leaves_the_skeleton_untouched(tmp_path, tokenizer_parts):
    tokens, _, eos = tokenizer_parts
    path = tmp_path / "gemma2.gguf"
    source = float_model("gemma2", len(tokens), eos)
    expected = write_llama_cpp_gguf(source, path, "gemma2", gguf.GGMLQuantizationType.Q8_0, tokenizer_parts)
    source.config.save_pretrained(tmp_path)
    model, report, _ = streamwise.load_pretrained(path, "auto")
    assert applied_state(model).source == str(tmp_path) and report.residents == {"gguf": 14}
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)

    wider = source.config.to_dict() | {"intermediate_size": 256}
    with streamwise.skeleton():
        other = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**wider)).eval()
    before = {n: (p.device, p.dtype) for n, p in other.named_parameters()}
    with pytest.raises(CheckpointError) as caught:
        streamwise.load(other, path, "transformers")
    assert f"{path}: tensor `model.layers.0.mlp.up_proj.weight`: shape [128, 64] in the file" in str(caught.value)
    assert {n: (p.device, p.dtype) for n, p in other.named_parameters()} == before
    assert all(p.is_meta for p in other.parameters()) and applied_state(other) is None


@pytest.mark.parametrize("family", list(MORE))
def test_more_architectures_load_from_the_gguf_alone(tmp_path, tokenizer_parts, family):
    tokens, _, eos = tokenizer_parts
    path = tmp_path / f"{family}.gguf"
    expected = write_llama_cpp_gguf(float_model(family, len(tokens), eos), path, family,
                                    gguf.GGMLQuantizationType.Q4_0, tokenizer_parts)
    model, report, _ = streamwise.load_pretrained(path, "auto")
    assert type(model).__name__ == type(expected).__name__
    assert report.residents["gguf"] == len(report.quantized) > 0
    assert set(report.quantized.values()) == {"Q4_0"}
    ids = torch.tensor([[eos, 5, 17, 42]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)


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
