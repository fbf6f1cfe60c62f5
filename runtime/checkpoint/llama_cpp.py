"""GGUF files in llama.cpp's converter layout (`blk.0.attn_q.weight`, model shape in metadata) into transformers models.

Nothing here keeps a name table or a transform of its own: the config comes from transformers' GGUF metadata
reader (`AutoConfig.from_pretrained(..., gguf_file=...)`), tensor names from transformers' map built on the
gguf package's `TensorNameMap` (`get_gguf_hf_weights_map`), and the value transforms llama.cpp's converter
applied (Q/K rotary permutation, Gemma's norm + 1, ...) are undone by transformers' own per-architecture
`TensorProcessor`. What a processor does to a tensor is learned by handing it the row indices first: when it
only reorders rows (the Q/K permutation) the quantized blocks move as whole rows and stay quantized; when it
leaves the tensor alone the blocks pass through; anything else (a value change) needs the values, so that
tensor is dequantized, processed exactly as transformers does, and the load report says so.

Before transformers reads anything, the model shape the metadata claims is checked against the tensors the file
holds (`check_shape`): the layer count against the `blk.N` layers present, every size against the file's largest
tensor dimension, each an integer of the sign llama.cpp writes; a hostile 130 KB file claiming 2,000 layers or a
head size of 2**40 is refused here, before a skeleton (and its rotary tables) is built. transformers then reads a
private copy of the checked header (`Checkpoint.header_copy`), never the file itself, and builds its name map once
per call (`_name_maps`), not once per module (quadratic in the layers: 18 s for 32 layers).
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from ..builders.scoped import ContextPatch
from ..quant.gguf_dequant import dequantize
from . import carried_files
from .readers import CheckpointError, open_checkpoint
from .stored import Checkpoint, StoredTensor

_FULL_PROBE_LIMIT = 1 << 26  # a row-index probe of a whole 2-D tensor, at most this many elements


ARCHITECTURES = ("bloom", "falcon", "gemma2", "gemma3", "gpt2", "lfm2", "llama", "mamba", "nemotron", "phi3", "qwen2",
                 "qwen2moe", "qwen3", "qwen3moe", "stablelm", "starcoder2", "t5", "t5encoder")
"""The `general.architecture` values Streamwise builds right, each proven against its float model on a file
llama.cpp's own converter wrote (`tests/checkpoint/test_llama_cpp_converter.py`, which also fails when this list
names one no test proves or leaves out one that is). `llama` covers Mistral and Mixtral, `t5` UMT5. transformers'
reader accepts more (Gemma 4, gpt-oss, MiniMax-M2, Deci); those are refused by name until a test proves them."""


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def _unsupported(path: str, architecture: str | None, detail: str = "") -> CheckpointError:
    return CheckpointError([
        f"{path}: a GGUF in llama.cpp's layout of architecture `{architecture}`, which Streamwise cannot build "
        f"right{detail}; the architectures it builds: {', '.join(supported_architectures())}"
    ])


def is_llama_cpp_file(checkpoint: Checkpoint) -> bool:
    """A GGUF that names an architecture other than Streamwise's own layout."""
    return checkpoint.kind == "gguf" and checkpoint.architecture not in (None, carried_files.ARCHITECTURE)


def is_llama_cpp_layout(checkpoint: Checkpoint, model: nn.Module) -> bool:
    """A GGUF not written by Streamwise whose tensor names are none of the model's own keys."""
    return is_llama_cpp_file(checkpoint) and not set(checkpoint.tensors) & set(model.state_dict(keep_vars=True))


def gguf_metadata(path: str | Path) -> dict:
    """transformers' parse of the file's metadata (`config`, `tokenizer`, ...), or a CheckpointError
    naming the architecture when transformers cannot map it. Parsed once per version of the file: building the
    skeleton and mapping the tensors both ask, and a 150k-token vocabulary takes seconds to parse."""
    stat = os.stat(path)
    return _parsed_metadata(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed_metadata(path: str, size: int, modified: int) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    checkpoint = open_checkpoint(path)  # strict read first: a lying header never reaches transformers
    if checkpoint.architecture is None:
        raise CheckpointError([f"{path}: no `general.architecture` string in the GGUF metadata, so nothing says "
                               "which model it holds"])
    if checkpoint.architecture not in ARCHITECTURES:
        raise _unsupported(path, checkpoint.architecture)
    try:
        with checkpoint.header_copy() as copy:
            parsed = load_gguf_checkpoint(copy, return_tensors=False)
    except ValueError as exc:
        if "not supported" in str(exc):
            raise _unsupported(path, checkpoint.architecture) from None
        raise CheckpointError([f"{path}: transformers cannot read this GGUF's metadata ({exc})"]) from None
    except CheckpointError:
        raise
    except Exception as exc:  # its parser signals a malformed field with many exception types
        raise CheckpointError([f"{path}: transformers cannot read this GGUF's metadata "
                               f"({type(exc).__name__}: {exc})"]) from None
    check_shape(checkpoint)  # before anything is built from what transformers read
    return parsed


# The sizes llama.cpp's converter writes (gguf's key names), which transformers reads into the config: per layer
# arrays are allowed where llama.cpp reads them (`get_key_or_arr`), and a size no tensor has is a lie.
_LAYERS, _CONTEXT = gguf.Keys.LLM.BLOCK_COUNT, gguf.Keys.LLM.CONTEXT_LENGTH
_POSITIVE = (_LAYERS, _CONTEXT, gguf.Keys.LLM.EMBEDDING_LENGTH, gguf.Keys.Attention.HEAD_COUNT,
             gguf.Keys.Attention.KEY_LENGTH, gguf.Keys.Attention.VALUE_LENGTH)
_PER_LAYER = (gguf.Keys.LLM.FEED_FORWARD_LENGTH, gguf.Keys.Attention.HEAD_COUNT, gguf.Keys.Attention.HEAD_COUNT_KV)
_SIZES = (*_POSITIVE, *_PER_LAYER, gguf.Keys.LLM.VOCAB_SIZE, gguf.Keys.LLM.EXPERT_COUNT,
          gguf.Keys.LLM.EXPERT_USED_COUNT, gguf.Keys.Rope.DIMENSION_COUNT)
_BLOCK = re.compile(r"(?:(.*)\.)?blk\.(\d+)\.")
_QUERY = re.compile(r"\.attn_q(?:kv|_a)?\.")  # an attention layer's query projection (fused, low-rank)


def check_shape(checkpoint: Checkpoint) -> None:
    """Refuse a llama.cpp-layout GGUF whose metadata claims a model its tensors are not (before anything is built):
    each size an integer (an array of them per layer where llama.cpp reads one) and not negative, the counts that
    cannot be 0 positive, every size but the context length at most the largest dimension of a tensor the file
    holds, and `block_count` the number of `blk.N` layers present, numbered from 0."""
    path, architecture, metadata = checkpoint.path, checkpoint.architecture, checkpoint.metadata
    largest = max((max(t.shape) for t in checkpoint.tensors.values() if t.shape and math.prod(t.shape)), default=0)
    attention = any(_QUERY.search(name) for name in checkpoint.tensors)
    problems, values = [], {}
    for template in dict.fromkeys(_SIZES):
        key = template.format(arch=architecture)
        found = metadata.get(key)
        if found is None:
            continue
        numbers = found.integers
        if numbers is None or (found.array and template not in _PER_LAYER) or not numbers:
            what = f"an array of {found.type.name}" if found.array else found.type.name
            problems.append(f"{path}: metadata `{key}`: {what}, where llama.cpp writes an integer")
            continue
        # a layer may have no heads (a state-space one), and a model without attention tensors none at all (Mamba)
        headless = template == gguf.Keys.Attention.HEAD_COUNT and not attention
        least = 0 if found.array or headless else int(template in _POSITIVE)
        if min(numbers) < least:
            problems.append(f"{path}: metadata `{key}` is {min(numbers)}; it must be at least {least}")
        elif template in _POSITIVE and not headless and max(numbers) < 1:
            problems.append(f"{path}: metadata `{key}` is 0 for every layer; some layer must have one")
        elif template not in (_LAYERS, _CONTEXT) and max(numbers) > largest:
            problems.append(f"{path}: metadata `{key}` is {max(numbers)}, larger than any dimension of the file's "
                            f"tensors ({largest})")
        values[template] = (key, numbers, found.array)
    if _LAYERS in values and not problems:
        problems += _layer_problems(checkpoint, values)
    if problems:
        raise CheckpointError(problems)


def _layer_problems(checkpoint: Checkpoint, values: dict) -> list[str]:
    key, (layers,), _ = values[_LAYERS]
    groups: dict[str, set[int]] = {}
    for name in checkpoint.tensors:
        if match := _BLOCK.match(name):
            groups.setdefault(match[1] or "", set()).add(int(match[2]))
    problems = [f"{checkpoint.path}: metadata `{k}` holds {len(n)} values, one per layer of the `{key}` {layers}"
                for k, n, array in values.values() if array and len(n) != layers]
    present = groups.get("", max(groups.values(), key=len, default=set()))
    if present != set(range(layers)) and not (not groups.get("") and len(present) >= layers > 0):
        held = f"layers {_ranges(present)}" if present else "no `blk.N` layer"
        problems.append(f"{checkpoint.path}: metadata `{key}` claims {layers} layers, but the file's tensors hold "
                        f"{held}")
    return problems


def _ranges(numbers: set[int]) -> str:
    ordered = sorted(numbers)
    return f"{ordered[0]}..{ordered[-1]} ({len(ordered)})" if len(ordered) > 3 else ", ".join(map(str, ordered))


def gguf_config(path: str | Path):
    """The transformers config the GGUF's own metadata describes (no config.json needed)."""
    import transformers

    gguf_metadata(path)  # the checks, with Streamwise's errors
    checkpoint = open_checkpoint(path)
    try:
        with checkpoint.header_copy() as copy:
            config = transformers.AutoConfig.from_pretrained(os.path.dirname(copy), gguf_file=os.path.basename(copy),
                                                             local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers signals a config it cannot build with many exception types
        if isinstance(exc, KeyError) and gguf.Keys.Tokenizer.LIST not in checkpoint.metadata:
            raise CheckpointError([f"{path}: transformers reads this architecture's config from the file's tokenizer, "
                                   "and it has no tokenizer (`tokenizer.ggml.model = none`): load it with its "
                                   "folder's config.json instead (`streamwise.load(model, file)`)"]) from None
        raise CheckpointError([f"{path}: transformers cannot build a config from this GGUF ({exc})"]) from None
    config = as_llama_cpp_builds(config, checkpoint)
    config._name_or_path = str(Path(path).parent)  # as transformers names it for the file itself
    return config


def as_llama_cpp_builds(config, checkpoint: Checkpoint):
    """`config` corrected where transformers' reader is wrong or silent, decided as llama.cpp's model graphs decide:
    from the metadata its converter writes and the tensors the file holds. A file whose model the config cannot
    describe is refused by name (`_unsupported`), never built approximately."""
    import transformers

    architecture, names = checkpoint.architecture, checkpoint.tensors.keys()

    def integer(template: str) -> int | None:
        found = checkpoint.metadata.get(template.format(arch=architecture))
        return None if found is None or found.integers is None else found.integers[0]

    def holds(part: str) -> bool:
        return any(f".{part}." in name for name in names)

    # the head size: transformers reads it for some architectures only (Qwen3 keeps its class default of 128)
    if (key_length := integer(gguf.Keys.Attention.KEY_LENGTH)) and isinstance(getattr(config, "head_dim", None), int):
        config.head_dim = key_length
    if architecture in ("t5", "t5encoder"):  # llama.cpp: gated GELU (tanh) where `ffn_gate` exists, else ReLU
        gated = holds("ffn_gate")
        config.feed_forward_proj, config.dense_act_fn, config.is_gated_act = (
            ("gated-gelu", "gelu_new", True) if gated else ("relu", "relu", False))
        # a head of its own (Flan-T5) or the embedding; scaled by d_model ** -0.5 only in the original T5 (ReLU, tied)
        config.tie_word_embeddings = "output.weight" not in names
        config.scale_decoder_outputs = config.tie_word_embeddings and not gated
    if architecture == "gpt2" and (context := integer(gguf.Keys.LLM.CONTEXT_LENGTH)):
        config.n_positions = context  # the rows of `position_embd`; transformers reads the context into `n_ctx`
    if architecture == "falcon" and holds("attn_norm_2"):  # Falcon-40B's layout: two norms, grouped key-values
        config.new_decoder_architecture = True
        config.num_kv_heads = integer(gguf.Keys.Attention.HEAD_COUNT_KV) or 1
        if config.num_kv_heads > 1:  # the converter regroups the fused QKV rows; undoing that is not built
            raise _unsupported(checkpoint.path, architecture, f" (a Falcon with {config.num_kv_heads} key-value "
                               "groups: llama.cpp's converter regroups their fused QKV rows)")
    for template, field in ((gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size"),
                            (gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, "shared_expert_intermediate_size")):
        if (width := integer(template)) is not None and hasattr(config, field):
            setattr(config, field, width)
    if architecture == "llama" and getattr(config, "sliding_window", None):  # transformers builds a file it finds
        config.sliding_window = None  # "mistral" in the name as Mistral, its class default 4096; llama.cpp: none
    if architecture == "llama" and holds("ffn_gate_exps"):  # Mixtral: llama.cpp writes it as a Llama with experts
        settings = {**config.to_dict(), "num_local_experts": integer(gguf.Keys.LLM.EXPERT_COUNT),
                    "num_experts_per_tok": integer(gguf.Keys.LLM.EXPERT_USED_COUNT)}
        settings.pop("model_type", None)
        config = transformers.MixtralConfig(**settings)
    embedding = checkpoint.tensors.get("token_embd.weight")
    if embedding is not None and hasattr(config, "vocab_size"):  # transformers counts the tokenizer's tokens, which
        config.vocab_size = embedding.shape[0]  # a file without one (`tokenizer.ggml.model = none`) lacks
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and not 0 <= pad < getattr(config, "vocab_size", pad + 1):
        config.pad_token_id = integer(gguf.Keys.Tokenizer.PAD_ID)  # a class default beyond this vocabulary
    return config


ROPE_FACTORS = "rope_freqs.weight"
"""llama.cpp's per-dimension rotary frequency divisors: how its converter stores Llama 3's `llama3` rope scaling."""


def with_rope_factors(model: nn.Module, checkpoint: Checkpoint) -> None:
    """`model`'s rotary frequencies divided by the file's `rope_freqs` as llama.cpp divides them (Llama 3.1 on keep
    their rope scaling there, which no metadata key or transformers' reader carries); a CheckpointError where the
    model has no rotary frequencies of that length to divide."""
    stored = checkpoint.tensors.get(ROPE_FACTORS)
    if stored is None:
        return
    factors = stored.read().float() if stored.qtype is None else dequantize(stored.read(), stored.qtype, stored.shape)
    rotary = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not rotary or any(tuple(m.inv_freq.shape) != tuple(factors.shape) for m in rotary):
        raise CheckpointError([f"{checkpoint.path}: `{ROPE_FACTORS}` holds {tuple(factors.shape)} factors and "
                               f"{type(model).__name__} has no rotary frequencies of that length to divide"])
    for module in rotary:
        for name in ("inv_freq", "original_inv_freq"):
            if isinstance(getattr(module, name, None), torch.Tensor):
                setattr(module, name, getattr(module, name) / factors.to(getattr(module, name).dtype))


_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEEPSEEK_LETTERS = (  # DeepSeek LLM's letters, as llama.cpp lists them
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕ"
    "Ἐ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤ"
    "Ⳬ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
# llama.cpp's pre-tokenizer regexes (`llm_tokenizer_bpe`, src/llama-vocab.cpp at 0c1e5709), each splitting the pieces
# the one before it left, for the `tokenizer.ggml.pre` values where transformers' conversion splits otherwise: each
# checked against llama.cpp's own test vectors (`tests/checkpoint/test_llama_cpp_vocabularies.py`)
_BPE_SPLITS = {
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_WORDS, "[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2_WORDS),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "deepseek-llm": ("[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+", "\\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                     "[一-龥ࠀ-一가-퟿]+", r"\p{N}+"),
}


# `tokenizer.ggml.pre` values for which llama.cpp takes a whole pre-token that is itself in the vocabulary before any
# merge (`ignore_merges`, as Llama 3's tokenizer.json says and transformers' GGUF conversion does not)
_WHOLE_WORDS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                          "jina-v5-nano", "minicpm5", "youtu"})


def as_llama_cpp_tokenizes(tokenizer, checkpoint: Checkpoint):
    """`tokenizer` (transformers' conversion of the file's vocabulary) corrected where it tokenizes otherwise than
    llama.cpp, which the file's model was trained to read:
    - a SentencePiece vocabulary (`tokenizer.ggml.model = llama`): llama.cpp prefixes every run of text with a space
      (unless `tokenizer.ggml.add_space_prefix` is false), also one that starts with spaces, then writes each space
      as `▁`; transformers' Metaspace skips the prefix where the text starts with a space (`' '` becomes `▁` where
      llama.cpp's `▁▁` is one token). Its legacy normalizer does what llama.cpp does.
    - a byte-level BPE whose `tokenizer.ggml.pre` transformers splits with GPT-2's regex (Falcon's digits in threes,
      StarCoder's digits one by one, DeepSeek Coder's): llama.cpp's own regexes, then the bytes;
    - a Llama 3 style BPE: a pre-token the vocabulary holds whole is that token (` Việt`), before any merge;
    - a byte-level BPE's control and user-defined tokens at their own ids (`_special_tokens_at_their_ids`)."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    model, pre = (checkpoint.metadata.get(key) for key in (gguf.Keys.Tokenizer.MODEL, gguf.Keys.Tokenizer.PRE))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or model is None:
        return tokenizer
    if model.value == "llama":
        prefix = checkpoint.metadata.get(gguf.Keys.Tokenizer.ADD_PREFIX)
        steps = [normalizers.Prepend("▁")] if prefix is None or prefix.value else []
        backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = None
    elif model.value == "gpt2" and pre is not None and pre.value in _BPE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in _BPE_SPLITS[pre.value]),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif model.value == "gpt2" and pre is not None and pre.value in _WHOLE_WORDS:
        backend.model.ignore_merges = True
    if model.value == "gpt2":
        _special_tokens_at_their_ids(tokenizer, checkpoint)
    return tokenizer


def _special_tokens_at_their_ids(tokenizer, checkpoint: Checkpoint) -> None:
    """llama.cpp holds a control or user-defined token as its text (DeepSeek's `<｜begin▁of▁sentence｜>`) and matches
    it whole; transformers' conversion byte-encodes it like any BPE piece (`<ï½ľbeginâĸģ...`), so the text no longer
    finds it, adds the BOS and EOS again past the vocabulary (with an unknown token GPT-2's converter assumes), and a
    prompt starts with an id the model has no row for. Each such token goes back to its text at its own id, matched
    whole; nothing stays past the file's vocabulary."""
    import json

    from tokenizers import Tokenizer

    kinds = checkpoint.metadata.get(gguf.Keys.Tokenizer.TOKEN_TYPE)
    if kinds is None or kinds.integers is None:
        return
    kinds = kinds.integers
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocabulary, added = state["model"]["vocab"], state["added_tokens"]
    texts = {index: token for token, index in vocabulary.items()}
    control, user = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
    byte_of = {character: byte for byte, character in gguf.vocab.bytes_to_unicode().items()}
    changed = [a for a in added if a["id"] >= len(kinds)]
    present = {a["id"] for a in added}
    for index, kind in enumerate(kinds):
        encoded = texts.get(index)
        if kind not in (control, user) or encoded is None:
            continue
        try:
            text = bytes(byte_of[c] for c in encoded).decode("utf-8")
        except (KeyError, UnicodeDecodeError):  # not byte-encoded: its text already
            text = encoded
        if text != encoded:
            del vocabulary[encoded]
            vocabulary[text] = index
            changed.append(index)
        if index not in present:
            added.append({"id": index, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == control})
            changed.append(index)
    if not changed:
        return
    state["added_tokens"] = sorted((a for a in added if a["id"] < len(kinds)), key=lambda a: a["id"])
    for entry in ((state.get("post_processor") or {}).get("special_tokens") or {}).values():
        entry["ids"] = [vocabulary[token] for token in entry["tokens"] if token in vocabulary]
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))


def _cached_name_maps(original, cache):
    """`gguf.get_tensor_name_map`, remembering each map for the calling context's `_NAME_MAPS` call."""

    def get_tensor_name_map(arch, n_blocks):
        maps = cache()
        if maps is None:
            return original(arch, n_blocks)
        if (arch, n_blocks) not in maps:
            maps[(arch, n_blocks)] = original(arch, n_blocks)
        return maps[(arch, n_blocks)]

    return get_tensor_name_map


# transformers' `get_gguf_hf_weights_map` rebuilds the name map (linear in the layers) for every module of the tree;
# within one call, in this thread only, it is built once
_NAME_MAPS = ContextPatch(gguf, "get_tensor_name_map", _cached_name_maps)


class Mapped:
    """A llama.cpp-layout GGUF seen under the model's state-dict keys, with what happened to each tensor."""

    def __init__(self, checkpoint: Checkpoint, model: nn.Module) -> None:
        from transformers import PreTrainedModel

        path, architecture = checkpoint.path, checkpoint.architecture
        if not isinstance(model, PreTrainedModel):
            raise _unsupported(path, architecture, f" ({type(model).__name__} is not a transformers model)")
        try:
            self.processor, self.names = _name_map(model, gguf_metadata(path)["config"], architecture)
        except NotImplementedError as exc:  # the gguf package has no name map for this model type
            raise _unsupported(path, architecture, f" ({exc})") from None
        self.checkpoint = checkpoint
        self.shapes = {key: tuple(value.shape) for key, value in model.state_dict(keep_vars=True).items()}
        self.tensors: dict[str, StoredTensor] = {}
        self.ignored: dict[str, str] = {}
        self.dequantized: dict[str, str] = {}  # model key -> why its values were needed
        side: dict = {"tensors": {}}  # what processors that merge or rename tensors write themselves
        for name, stored in checkpoint.tensors.items():
            self._map(name, stored, side)
        for key, tensor in side["tensors"].items():
            self._add(key, StoredTensor(key, path, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t,
                                        note=f"assembled by transformers' {type(self.processor).__name__}"))
        # a weight the model class declares shared with another (T5's encoder and decoder embeddings are its
        # `shared`) reads the file's one tensor also where the config unties them (Flan-T5's head of its own)
        for key, source in (getattr(type(model), "_tied_weights_keys", None) or {}).items():
            if key not in self.tensors and source in self.tensors:
                self._add(key, replace(self.tensors[source], name=key))

    def checkpoint_view(self) -> Checkpoint:
        return replace(self.checkpoint, tensors=self.tensors)

    def _add(self, key: str, stored: StoredTensor) -> None:
        if stored.note is not None:
            self.dequantized.setdefault(key, stored.note)
        self.tensors[key] = stored

    def _map(self, name: str, stored: StoredTensor, side: dict) -> None:
        processor = type(self.processor).__name__
        action = _probe(self.processor, name, stored.shape, self.names)
        if action is not None:
            key = self.names.get(name)
            if key is None:
                self.ignored[name] = "transformers maps it to no parameter of this model (it skips it too)"
                return
            self._add(key, replace(stored, name=key, read=_reordered(stored, action)))
            return
        # the processor changes values: it needs them, in float32 as transformers hands them over
        if stored.qtype is not None:
            values = dequantize(stored.read(), stored.qtype, stored.shape, torch.float32)
            note = f"dequantized from {stored.qtype.name}: transformers' {processor} changes its values"
        else:
            values, note = stored.read().float(), None
        result = self.processor.process(weights=values.numpy(), name=name, tensor_key_mapping=self.names,
                                        parsed_parameters=side)
        if result.name is None:  # the processor placed it in `side` itself
            return
        key = self.names.get(result.name)
        if key is None:
            self.ignored[name] = "transformers maps it to no parameter of this model (it skips it too)"
            return
        tensor = torch.from_numpy(np.ascontiguousarray(result.weights))
        if tuple(tensor.shape[:1]) == (1,) and tuple(tensor.shape[1:]) == self.shapes.get(key):
            tensor = tensor[0]  # Qwen2-MoE's processor gives the shared-expert gate, 1-D in older files, a row axis
        if stored.qtype is None:
            tensor = tensor.to(stored.dtype)  # a float tensor keeps its stored dtype, as transformers' own path does
        self._add(key, StoredTensor(key, stored.file, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t,
                                    note=note))


# transformers' model types whose llama.cpp architecture is named otherwise (its `get_gguf_hf_weights_map` renames)
_ARCHITECTURE_OF = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "umt5": "t5",
                    "mixtral": "llama", "mistral": "llama", "cohere": "command-r", "minimax_m2": "minimax-m2",
                    "gpt_oss": "gpt-oss"}


def _name_map(model: nn.Module, config: dict, architecture: str):
    """transformers' tensor processor for llama.cpp `architecture` (Mixtral's own, `_mixtral_processor`) and its map
    of llama.cpp names onto `model`'s keys (`get_gguf_hf_weights_map`, the name map built once per call): read here,
    written the other way round by `llama_cpp_layout`. NotImplementedError where the gguf package has no name map for
    the model's type."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    mixtral = model.config.model_type == "mixtral"  # written by llama.cpp as a Llama with experts
    as_llama = model.config.model_type in ("mixtral", "mistral")
    processor = _mixtral_processor(config) if mixtral else TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
        config=config)
    with _NAME_MAPS.active({}):
        return processor, get_gguf_hf_weights_map(model, processor, model_type="llama" if as_llama else None)


def _mixtral_processor(config: dict):
    """Mixtral as llama.cpp's converter writes it: Llama's Q/K rows undone by transformers' Llama processor, the
    experts assembled as transformers' Qwen2-MoE processor assembles the same `ffn_*_exps` tensors."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, Qwen2MoeTensorProcessor

    class MixtralTensorProcessor(Qwen2MoeTensorProcessor):
        def __init__(self, config=None):
            super().__init__(config=config)
            self.llama = LlamaTensorProcessor(config=config)

        def process(self, weights, name: str, **kwargs):
            if self.GGUF_MOE_WEIGHTS_PATTERN.fullmatch(name):
                return super().process(weights, name, **kwargs)
            return self.llama.process(weights, name, **kwargs)

    return MixtralTensorProcessor(config=config)


def _probe(processor, name: str, shape: tuple[int, ...], names: dict[str, str]):
    """What `processor` does to a tensor of `shape`, learned from row indices: `True` when it leaves it as it
    is, a row permutation (an index array) when it only reorders rows, None for anything else."""
    if not shape:
        return None
    rows = math.prod(shape[:-1]) if len(shape) > 1 else shape[0]
    index = np.arange(rows, dtype=np.int64).reshape(*shape[:-1], 1) if len(shape) > 1 else np.arange(rows)
    probes = [index]
    if len(shape) == 2 and math.prod(shape) <= _FULL_PROBE_LIMIT:  # a processor that reads the column count
        probes.append(np.broadcast_to(index, shape).copy())
    for probe in probes:
        try:
            with np.errstate(all="ignore"):
                result = processor.process(weights=probe.copy(), name=name, tensor_key_mapping=names,
                                           parsed_parameters={"tensors": {}})
        except Exception:
            continue
        if result.name != name or not isinstance(result.weights, np.ndarray) or result.weights.shape != probe.shape:
            return None
        if np.array_equal(result.weights, probe):
            return True
        if len(shape) == 1 and np.array_equal(np.sort(result.weights), probe):  # a bias in another order
            return torch.from_numpy(result.weights.astype(np.int64))
        if len(shape) != 2:
            return None
        rows_now = result.weights[:, 0]
        if (result.weights == rows_now[:, None]).all() and np.array_equal(np.sort(rows_now), np.arange(shape[0])):
            return torch.from_numpy(rows_now.astype(np.int64))
        return None
    return None


def _reordered(stored: StoredTensor, action):
    """`stored.read`, with its rows in the order `action` gives (whole rows of blocks for a quantized tensor)."""
    if action is True:
        return stored.read

    def read():
        data = stored.read()
        return data.reshape(stored.shape[0], -1)[action].reshape(data.shape)

    return read
