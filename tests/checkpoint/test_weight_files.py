"""Which file of a folder holds its weights: the names transformers and diffusers write, variants chosen by dtype."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from streamwise.runtime.checkpoint.readers import CheckpointError, open_checkpoint
from streamwise.runtime.checkpoint.weight_files import NoWeights, is_shard_index, weights_file

DIFFUSERS = "diffusion_pytorch_model"


@pytest.mark.parametrize("names, variant, chosen", [
    (["model.safetensors"], None, "model.safetensors"),
    (["weights.safetensors", "model.gguf"], None, "weights.safetensors"),  # one .safetensors, any name, as before
    (["model.gguf"], None, "model.gguf"),
    ([f"{DIFFUSERS}.safetensors"], None, f"{DIFFUSERS}.safetensors"),
    ([f"{DIFFUSERS}.safetensors.index.json", f"{DIFFUSERS}-00001-of-00002.safetensors",
      f"{DIFFUSERS}-00002-of-00002.safetensors"], None, f"{DIFFUSERS}.safetensors.index.json"),
    ([f"{DIFFUSERS}.safetensors", f"{DIFFUSERS}.fp16.safetensors"], None, f"{DIFFUSERS}.safetensors"),
    ([f"{DIFFUSERS}.safetensors", f"{DIFFUSERS}.fp16.safetensors"], "fp16", f"{DIFFUSERS}.fp16.safetensors"),
    ([f"{DIFFUSERS}.safetensors", f"{DIFFUSERS}.fp16.safetensors"], "bf16", f"{DIFFUSERS}.safetensors"),
    ([f"{DIFFUSERS}.fp16.safetensors"], None, f"{DIFFUSERS}.fp16.safetensors"),  # the only one
    (["model.fp16.safetensors", "model.bf16.safetensors"], "bf16", "model.bf16.safetensors"),
    (["model.safetensors.index.fp16.json", "model.fp16-00001-of-00002.safetensors",
      "model.fp16-00002-of-00002.safetensors"], None, "model.safetensors.index.fp16.json"),
    (["model.safetensors.index.fp16.json", "model.safetensors"], None, "model.safetensors"),  # the plain one
    (["model.safetensors.index.fp16.json", "model.safetensors"], "fp16", "model.safetensors.index.fp16.json"),
    (["model.safetensors.index.json", "model.safetensors"], None, "model.safetensors.index.json"),  # as before
])
def test_the_weights_of_a_folder(names, variant, chosen):
    assert weights_file(names, variant) == chosen


@pytest.mark.parametrize("names, reason", [
    ([], "expected `model.safetensors.index.json`"),
    (["a.safetensors", "b.safetensors"], "one .safetensors or .gguf file"),
    (["model.safetensors", "extra.safetensors"], "one .safetensors or .gguf file"),  # not variants of one file
    (["a.gguf", "b.gguf"], "one .safetensors or .gguf file"),
    (["model.fp16.safetensors", "model.bf16.safetensors"], "the variants bf16, fp16 of its `model` weights"),
    (["model.safetensors", f"{DIFFUSERS}.safetensors"], "holds both"),
])
def test_a_folder_that_names_no_one_set_of_weights_says_why(names, reason):
    with pytest.raises(NoWeights, match=reason):
        weights_file(names)


def test_shard_indexes_by_name():
    assert is_shard_index("model.safetensors.index.json") and is_shard_index("anything.index.json")
    assert is_shard_index(f"{DIFFUSERS}.safetensors.index.fp16.json")
    assert not is_shard_index("model.safetensors") and not is_shard_index("config.json")


def test_open_checkpoint_picks_the_variant_of_the_dtype_and_keeps_its_checks(tmp_path):
    plain, half = {"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float16)}
    safetensors.torch.save_file(plain, tmp_path / f"{DIFFUSERS}.safetensors")
    safetensors.torch.save_file(half, tmp_path / f"{DIFFUSERS}.fp16.safetensors")
    assert open_checkpoint(tmp_path).path.endswith(f"{DIFFUSERS}.safetensors")
    assert open_checkpoint(tmp_path, torch.float16).tensors["w"].dtype == torch.float16
    assert open_checkpoint(tmp_path, torch.bfloat16).tensors["w"].dtype == torch.float32  # no bf16 variant: plain
    (tmp_path / f"{DIFFUSERS}.safetensors").unlink()
    safetensors.torch.save_file(plain, tmp_path / f"{DIFFUSERS}.bf16.safetensors")
    with pytest.raises(CheckpointError, match=f"{tmp_path}: holds the variants bf16, fp16 .* pass the dtype"):
        open_checkpoint(tmp_path)
    (tmp_path / f"{DIFFUSERS}.fp16.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}")  # a lying header
    with pytest.raises(CheckpointError, match="header claims 8 bytes"):
        open_checkpoint(tmp_path, torch.float16)
