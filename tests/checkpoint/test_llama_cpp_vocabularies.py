"""llama.cpp's own vocab-only GGUFs and tokenizer test vectors: each loads as a tokenizer or is refused naming the
file, and the ones transformers' GGUF conversion reproduces give llama.cpp's token ids on every vector.

Llama 2's SentencePiece file is committed (`tests/fixtures/llama_cpp_vocab`); the others run where
`llama_cpp_files` has fetched llama.cpp's vocabularies into the test cache (`llama_cpp_files.llama_cpp_vocabulary`),
and say so when skipped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamwise.runtime.checkpoint import CheckpointError, load_tokenizer

from llama_cpp_files import vocabulary, write_gguf

EXACT = ["llama-spm", "phi-3", "gpt-2", "qwen2", "falcon", "starcoder", "deepseek-coder", "deepseek-llm", "llama-bpe"]
"""Vocabularies whose every vector gives llama.cpp's ids (Qwen3.5's too, 50/50, left out for time), through
`llama_cpp.as_llama_cpp_tokenizes` where transformers' conversion differs (llama-spm 31/46, falcon 37/46,
starcoder, deepseek-coder, deepseek-llm and llama-bpe 45/46 without it)."""
REFUSED = ["bert-bge", "mpt", "refact"]
"""transformers builds no tokenizer from these, architectures its GGUF reader does not know (so neither from Command-R
and, past its config, Gemma 4: 17 and 33 s to parse, left out for time)."""


def vectors(path: Path) -> list[tuple[str, list[int]]]:
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    texts = texts[:-1] if texts[-1] == "" else texts
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=False)]


@pytest.mark.parametrize("name", EXACT)
def test_a_vocab_only_gguf_tokenizes_as_llama_cpp_does(name):
    path = vocabulary(name)
    tokenizer = load_tokenizer(path)
    cases = vectors(path)
    assert len(cases) >= 40
    differing = [(text, ids) for text, ids in cases if tokenizer(text, add_special_tokens=False)["input_ids"] != ids]
    assert differing == []


@pytest.mark.parametrize("name", REFUSED)
def test_a_vocabulary_transformers_cannot_build_is_refused_naming_the_file(name):
    path = vocabulary(name)
    with pytest.raises(CheckpointError) as caught:
        load_tokenizer(path)
    assert str(path) in str(caught.value) and "transformers builds no tokenizer" in str(caught.value)


def test_a_gguf_without_a_tokenizer_says_where_to_load_one_from(tmp_path):
    path = tmp_path / "weights-only.gguf"
    write_gguf(path, "llama", {"token_embd.weight": np.zeros((8, 32), dtype=np.float32)})
    with pytest.raises(CheckpointError, match=r"weights-only\.gguf: the file carries no tokenizer .*load_tokenizer"):
        load_tokenizer(path)


def test_a_control_token_beyond_ascii_is_the_files_own_id_matched_whole(tmp_path):
    """DeepSeek's `<｜begin▁of▁sentence｜>`: transformers' conversion byte-encodes it, adds the BOS again past the
    vocabulary, and prompts start with an id the model has no row for; llama.cpp holds it as its text."""
    import gguf

    pieces = list(gguf.vocab.bytes_to_unicode().values())  # every byte, as byte-level BPE writes it
    tokens = [*pieces, "Ġh", "<｜begin▁of▁sentence｜>", "<｜fim▁hole｜>"]
    types = [1] * (len(pieces) + 1) + [3, 4]  # normal, control, user-defined
    bos = len(pieces) + 1
    path = tmp_path / "vocab.gguf"
    write_gguf(path, "llama", {}, {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
                                   "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                   "tokenizer.ggml.merges": ["Ġ h"], "tokenizer.ggml.bos_token_id": bos,
                                   "tokenizer.ggml.eos_token_id": bos, "tokenizer.ggml.add_bos_token": True})

    tokenizer = load_tokenizer(path)

    assert len(tokenizer) == len(tokens) and tokenizer.bos_token_id == bos
    assert tokenizer("<｜fim▁hole｜> h")["input_ids"] == [bos, bos + 1, len(pieces)]
