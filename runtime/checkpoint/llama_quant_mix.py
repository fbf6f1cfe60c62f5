"""llama-quantize's K-quant mixes, Q4_K_M and Q5_K_M: each tensor's GGML type from its llama.cpp name, as
`llama_tensor_get_type` (`src/llama-quant.cpp`, llama.cpp 0c1e5709) chooses it without an importance matrix or
overrides.

The rules are keyed on tensor roles, which llama.cpp reads from its own tensor names (`blk.3.attn_v.weight`):
the output head and a tied token embedding take Q6_K (Q8_0 where rows do not fill 256-value blocks, and for
Falcon); the value projections (`attn_v`, fused `attn_qkv`, `attn_kv_b`) and the `ffn_down` projections of the
first and last eighth of the layers and of every third layer between take Q6_K (`use_more_bits`); 8-expert models
(Mixtral) keep `attn_v` and `attn_k` at Q8_0 and `attn_output` at Q5_K; every other weight matrix takes the mix's
base type. A type whose blocks a row does not fill falls back (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, then F16).
Norms, 1-D tensors, expert routers, position embeddings and Mamba's convolutions keep their type.
`streamwise quantize` names state-dict tensors by llama.cpp's names through the gguf package's `TensorNameMap`
first (`gguf_writer`); a model it has no map for cannot take a mix.
"""

from __future__ import annotations

import re

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

MIXES = {"Q4_K_M": Q.Q4_K, "Q5_K_M": Q.Q5_K}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_KEPT = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
         "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight")
_NOT_QUANTIZED = ("position_embd.weight", "token_types.weight")
_LAYER = re.compile(r"blk\.(\d+)\.")


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize quantizes a tensor at all (`tensor_allows_quantization`): ggml counts a tensor's
    dimensions up to its last one longer than 1 (`ggml_n_dims`), so a (1, 256) router is 1-D and kept."""
    dims = len(shape) - next((i for i, size in enumerate(shape) if size > 1), len(shape))
    return (dims >= 2 and name.endswith("weight") and not any(part in name for part in _KEPT)
            and name not in _NOT_QUANTIZED)


def _role(name: str) -> str:
    """`tensor_get_category`: the role llama.cpp's rules key on."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for role in ("attn_qkv", "attn_kv_b", "attn_v", "attn_k", "attn_q", "attn_output"):
        if f"{role}.weight" in name:
            return role
    return next((role for role in ("ffn_up", "ffn_gate", "ffn_down") if role in name), "other")


def _more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_types(mix: str, tensors: dict[str, tuple[int, ...]], *, architecture: str, layers: int, experts: int = 0,
              seventy_b: bool = False) -> dict[str, Q]:
    """The GGML type `mix` gives each tensor llama-quantize quantizes, by llama.cpp name. `tensors` maps names to
    shapes in torch's order (rows first, the row length last); the counters of value and down projections run in
    llama-quantize's order (by layer, then by name; `weight_name_comparer`). `seventy_b` is llama.cpp's
    `LLM_TYPE_70B` (an 80-layer Llama with grouped keys), which takes Q5_K for a Q4_K value projection."""
    base = MIXES[mix]
    value_projections = sum(_role(name) in ("attn_qkv", "attn_kv_b", "attn_v") for name in tensors)
    tied = "output.weight" not in tensors
    chosen, value_index, down_index = {}, 0, 0
    for name, shape in sorted(tensors.items(), key=llama_order):
        if not quantized(name, shape):
            continue
        role, columns, kind = _role(name), shape[-1], base
        if role == "output" or (tied and role == "token_embd"):
            kind = Q.Q8_0 if architecture == "falcon" or columns % 256 else Q.Q6_K
        elif role in ("attn_qkv", "attn_kv_b", "attn_v"):
            if _more_bits(value_index, value_projections):
                kind = Q.Q6_K
            if seventy_b and kind == Q.Q4_K:
                kind = Q.Q5_K
            if experts == 8:
                kind = Q.Q8_0
            value_index += 1  # (a fused QKV never reaches llama.cpp's own QKV rule: the value rules come first)
        elif role == "attn_k" and experts == 8:
            kind = Q.Q8_0
        elif role == "ffn_down":
            layer = int(_LAYER.search(name)[1]) if experts > 1 else down_index
            if architecture == "falcon" and mix == "Q4_K_M":
                kind = Q.Q6_K if layer < layers // 16 else Q.Q5_K if _more_bits(layer, layers) else Q.Q4_K
            elif _more_bits(layer, layers):
                kind = Q.Q6_K
            down_index += 1
        elif role == "attn_output" and experts == 8 and architecture != "falcon" and mix == "Q4_K_M":
            kind = Q.Q5_K
        chosen[name] = fitting(kind, columns)
    return chosen


def llama_order(item: tuple[str, object]) -> tuple[int, str]:
    """llama-quantize's order of (name, ...) items: tensors of no layer first, then by layer, each by name."""
    layer = _LAYER.match(item[0])
    return (int(layer[1]) if layer else -1, item[0])


def fitting(kind: Q, columns: int) -> Q:
    """`tensor_type_fallback`: a type whose blocks rows of `columns` fill (F16 where a type has no fallback)."""
    if columns % GGML_QUANT_SIZES[kind][0] == 0:
        return kind
    kind = _FALLBACK.get(kind, Q.F16)
    return kind if columns % GGML_QUANT_SIZES[kind][0] == 0 else Q.F16
