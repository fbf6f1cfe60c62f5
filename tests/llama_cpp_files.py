"""GGUF files in llama.cpp's converter layout, written by the gguf package's own writer and name maps, for tests.

The transforms are llama.cpp's `convert_hf_to_gguf.py` ones (Q/K rotary permutation for Llama, norm + 1 for Gemma);
quantization is `gguf.quants.quantize` the way llama.cpp quantizes (2-D weights in blocks, 1-D tensors in F32); the
tokenizer is a byte-level BPE trained offline, in the metadata.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import torch
import transformers

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, streaming weights", "a tiny model says hi"]
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)


def train_tokenizer_parts() -> tuple[list[str], list[str], int]:
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
