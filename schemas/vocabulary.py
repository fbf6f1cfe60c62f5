"""The fixed words of the policy format.

Invariants:
- a policy names compute kinds, quant formats and compile modes only from these tables, so loading one never
  imports or evaluates anything;
- the runtime registers one handler per word, and a test checks that every word has one;
- each entry's one-line description is what the JSON Schema shows in editors (editing one means regenerating it).
"""

from __future__ import annotations

COMPUTE_KINDS: dict[str, str] = {
    "linear": "torch.nn.Linear semantics: y = x @ W.T + b.",
    "embedding": "torch.nn.Embedding lookup (padding_idx, max_norm and friends honoured).",
    "conv1d": "torch.nn.Conv1d, including padding modes and groups.",
    "conv2d": "torch.nn.Conv2d, including padding modes and groups.",
    "conv3d": "torch.nn.Conv3d, including padding modes and groups.",
    "conv_transpose1d": "torch.nn.ConvTranspose1d.",
    "conv_transpose2d": "torch.nn.ConvTranspose2d.",
    "layer_norm": "torch.nn.LayerNorm over the trailing dimensions.",
    "group_norm": "torch.nn.GroupNorm.",
    "rms_norm": "torch.nn.RMSNorm (torch.nn.functional.rms_norm).",
    "llama_rms_norm": "transformers' LlamaRMSNorm/Qwen2RMSNorm: fp32 statistics, scale applied after the cast back.",
    "conv_layer_norm": (
        "Channels-first LayerNorm (VibeVoice ConvLayerNorm): transpose, fp32 layer norm, transpose back."
    ),
    "conv_rms_norm": "Channels-first RMSNorm (VibeVoice ConvRMSNorm): transpose, llama-style RMS norm, transpose back.",
    "generic": (
        "Any module with parameters, leaf or container: its direct parameters are fetched for the call and its own "
        "forward runs, so the result is the unconverted module's by construction."
    ),
}

#: The stream-rule kind that picks, per class, a specific kind where one provably reproduces the class, else
#: `generic` (the plan says which and why).
AUTO_KIND = "auto"
AUTO_KIND_DESCRIPTION = "Per class: a specific kind where it provably reproduces the class, else `generic`."

#: What `holds` selects: modules with direct parameters, or with direct buffers and no direct parameters.
HOLDS: dict[str, str] = {
    "parameters": "Modules holding direct parameters (any class): the catch-all of a stream section.",
    "buffers-only": "Modules holding direct buffers and no direct parameters: the catch-all of a relocate section.",
}

QUANT_FORMATS: dict[str, str] = {
    "none": "Keep the weights in their float dtype; an explicit skip that beats broader rules.",
    "gguf": "Keep GGUF tensors in their raw GGML blocks; the quant type of each tensor comes from the file.",
    "int8": "Symmetric per-output-row INT8 weights with fp32 scales.",
    "convrot_int8": "INT8 after a group-wise Hadamard rotation of weights and activations (ConvRot).",
    "convrot_int4": "INT4, two per byte, with per-group scales after a ConvRot rotation; not compile-safe.",
}

#: GGML types `streamwise quantize` can write (those the gguf package quantizes, and the K-quants it does not:
#: `runtime/quant/k_quants.py`), for `gguf_type`.
GGUF_WRITE_TYPES: tuple[str, ...] = (
    "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "MXFP4", "TQ2_0", "TQ1_0", "F16", "BF16", "F32",
)
DEFAULT_GGUF_TYPE = "Q8_0"
GGUF_LAYOUTS = ("auto", "llama.cpp", "streamwise")
"""How `streamwise quantize` lays a GGUF out: llama.cpp's (its names, metadata and tokenizer, so llama.cpp runs it), or
the model's state-dict names (any model); `auto` is llama.cpp's where it holds the model exactly."""

#: Formats whose rules take a `group_size`.
GROUPED_QUANT_FORMATS: frozenset[str] = frozenset({"convrot_int8", "convrot_int4"})
#: Formats whose kernels take a Linear's weight (a rule selecting anything else is `quant-unsupported`).
LINEAR_ONLY_QUANT_FORMATS: frozenset[str] = frozenset({"int8", "convrot_int8", "convrot_int4"})
DEFAULT_GROUP_SIZE = 256


def is_power_of_4(size: int) -> bool:
    """Whether `size` is 4, 16, 64, ...: a ConvRot group size, the order of a Kronecker power of the 4x4
    Hadamard matrix (1 is left out: a group of one rotates nothing)."""
    return size >= 4 and not size & (size - 1) and (size.bit_length() - 1) % 2 == 0


COMPILE_MODES: dict[str, str] = {
    "default": "Balanced compile time and speed.",
    "reduce-overhead": "CUDA graphs to cut Python and launch overhead.",
    "max-autotune": "Autotuned kernels and CUDA graphs; slowest to compile.",
    "max-autotune-no-cudagraphs": "Autotuned kernels without CUDA graphs.",
}

#: Backends torch ships; others are accepted with a warning and checked when compiling.
KNOWN_COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager", "cudagraphs")
