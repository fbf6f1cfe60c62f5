"""The size limits of checkpoint headers and metadata, each checked before the step it bounds allocates.

A header is parsed in one linear pass, and every count or length it claims is checked against the bytes the file
still holds (and against these limits) before anything is built for it, so a small hostile file can never cost
more than its size in time or memory. The limits are far above what real checkpoints need (the largest in use
named beside each) and, where a format's library has one, they are the library's own.
"""

from __future__ import annotations

MAX_SAFETENSORS_HEADER = 100_000_000
"""A safetensors header's bytes: the safetensors library's own limit."""
MAX_INDEX_BYTES = 64 * 2**20
"""A shard index (`model.safetensors.index.json`); DeepSeek-V3's, one of the largest, is 9 MB."""
MAX_SHARDS = 10_000
"""Shard files one index names (DeepSeek-V3: 163)."""
MAX_TENSOR_NAME = 512
"""Bytes of a tensor name, either format (the longest state-dict keys are about 150)."""
MAX_GGUF_DIMS = 4
"""Dimensions of a GGUF tensor: llama.cpp's `GGML_MAX_DIMS` (none is a scalar, as llama.cpp reads it)."""
MAX_ORIGINAL_DIMS = 8
"""Dimensions of a tensor a GGUF stores in another shape (`gguf_reader.ORIGINAL_SHAPE`): a Conv3d's 5, with room."""
MAX_GGUF_TENSORS = 2**17
"""Tensors in one GGUF file (DeepSeek-V3 in llama.cpp's layout holds 1,025)."""
MAX_GGUF_KEYS = 2**16
"""Metadata keys in one GGUF file (real files hold about 40)."""
MAX_GGUF_KEY = 2**16 - 1
"""Bytes of a GGUF metadata key: the format's own limit."""
MAX_GGUF_ARRAY_ITEMS = 2**22
"""Items of all GGUF metadata arrays together: Gemma 4's tokenizer, the largest known, holds 1,301,398 (262,144 tokens,
scores and types, 514,906 merges); a 350k-token BPE vocabulary with its merges passes 2**20. transformers' GGUF reader
spends about 30 µs and 1.5 KB on each, so this bounds what it costs too (a file must hold the items' bytes)."""
MAX_GGUF_HEADER = 128 * 2**20
"""Bytes of a GGUF file's metadata and tensor table, read into memory once (a 262k-token tokenizer takes 6 MB)."""
MAX_ELEMENTS = 2**63
"""Elements of one tensor, counting a zero-size dimension as 1: what torch can index (a zero-element tensor with
a dimension of 2**64 - 1 would otherwise pass every size check)."""
