"""diffusers model folders (`config.json` with `_class_name`, `diffusion_pytorch_model*.safetensors`): built as that
class on meta, loaded whole, sharded or as a variant, and streamed at budget 0 to exactly what the model in memory
computes."""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch

import streamwise
from streamwise.runtime.builders.model_spec import ModelSpecError
from streamwise.runtime.builders.skeleton import built_skeleton
from streamwise.runtime.checkpoint.readers import CheckpointError

from helpers import DIFFUSERS_SAMPLE, tiny_diffusers

diffusers = pytest.importorskip("diffusers")

LAYOUTS = {"plain": {}, "variant": {"variant": "fp16"}, "sharded": {"max_shard_size": "20KB"}}
FILES = {"plain": "diffusion_pytorch_model.safetensors", "variant": "diffusion_pytorch_model.fp16.safetensors",
         "sharded": "diffusion_pytorch_model.safetensors.index.json"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", DIFFUSERS_SAMPLE)
def test_a_diffusers_folder_loads_and_streams_to_what_the_model_computes(tmp_path, name, layout):
    model, inputs = tiny_diffusers(name)
    model.save_pretrained(tmp_path, **LAYOUTS[layout])
    with torch.no_grad():
        expected = model(**inputs).sample
    loaded, report, chosen = streamwise.load_pretrained(tmp_path, "any-module", progress=False)
    assert isinstance(loaded, type(model))
    assert report.built == f"{type(model).__name__} (diffusers `_class_name`)"
    assert report.file.endswith(FILES[layout]) and report.tensors == len(model.state_dict())
    streamwise.offload(loaded, "any-module", device="cpu", budget=0)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).sample, expected)


def test_the_variant_of_the_dtype_asked_for_else_the_plain_file(tmp_path):
    model, _ = tiny_diffusers("vae")
    model.save_pretrained(tmp_path)
    model.half().save_pretrained(tmp_path, variant="fp16")  # diffusers keeps the dtype: this one holds float16
    loaded, report, _ = streamwise.load_pretrained(tmp_path, "any-module", progress=False)
    assert report.file.endswith(FILES["plain"]) and {p.dtype for p in loaded.parameters()} == {torch.float32}
    loaded, report, _ = streamwise.load_pretrained(tmp_path, "any-module", dtype=torch.float16, progress=False)
    assert report.file.endswith(FILES["variant"]) and {p.dtype for p in loaded.parameters()} == {torch.float16}
    _, report, _ = streamwise.load_pretrained(tmp_path, "any-module", dtype=torch.bfloat16, progress=False)
    assert report.file.endswith(FILES["plain"])  # no bf16 variant: the plain file, converted


def test_the_skeleton_has_parameters_on_meta_real_buffers_and_fetches_nothing(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = diffusers.PriorTransformer(num_attention_heads=2, attention_head_dim=8, num_layers=1, embedding_dim=16,
                                       num_embeddings=4, additional_embeddings=2)
    model.save_pretrained(tmp_path)

    def no_network(*args, **kwargs):
        raise AssertionError("building a skeleton reached for the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    skeleton, how = built_skeleton(tmp_path, torch.bfloat16)
    assert how == "PriorTransformer (diffusers `_class_name`)" and not skeleton.training
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in skeleton.parameters())
    mask = dict(skeleton.named_buffers())["causal_attention_mask"]  # computed in __init__, in no checkpoint
    assert not mask.is_meta and torch.equal(mask, model.causal_attention_mask.to(mask.dtype))
    assert torch.get_default_dtype() == torch.float32


def test_the_caller_names_another_diffusers_class_or_is_told_the_one_it_meant(tmp_path):
    model, inputs = tiny_diffusers("unet")
    model.save_pretrained(tmp_path)
    for asked in ("UNet2DConditionModel", diffusers.UNet2DConditionModel):
        _, report, _ = streamwise.load_pretrained(tmp_path, "any-module", model_class=asked, progress=False)
        assert report.built == "UNet2DConditionModel (asked for)"
    with pytest.raises(ModelSpecError, match="diffusers has no model class `UNet2DConditionModle`; did you mean "
                                             "`UNet2DConditionModel`?"):
        streamwise.load_pretrained(tmp_path, "any-module", model_class="UNet2DConditionModle")
    with pytest.raises(ModelSpecError, match="must be a diffusers model class or its name for the diffusers folder"):
        streamwise.load_pretrained(tmp_path, "any-module", model_class=streamwise.runtime.PolicyError)


def test_a_class_name_diffusers_does_not_have_is_named(tmp_path):
    model, _ = tiny_diffusers("vae")
    model.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"AutoencoderKL"', '"AutoencoderKl"')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelSpecError, match="diffusers has no model class `AutoencoderKl`; did you mean "
                                             "`AutoencoderKL`?"):
        streamwise.load_pretrained(tmp_path, "any-module")


def test_without_diffusers_a_diffusers_folder_says_to_install_it(tmp_path, monkeypatch):
    model, _ = tiny_diffusers("vae")
    model.save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` fails as if it were not installed
    with pytest.raises(ModelSpecError, match="describes the diffusers model `AutoencoderKL`; building it needs "
                                             "diffusers: pip install diffusers"):
        streamwise.load_pretrained(tmp_path, "any-module")


def test_a_pipeline_folder_loads_a_component_by_name_and_lists_them_without_one(tmp_path):
    pipeline = tmp_path / "pipeline"
    for name in ("unet", "vae"):
        model, _ = tiny_diffusers(name)
        model.save_pretrained(pipeline / name)
    (pipeline / "scheduler").mkdir()
    (pipeline / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "PNDMScheduler"]}))
    listed = r"load one of its components with component=NAME .*: unet \(UNet2DConditionModel\), vae \(AutoencoderKL\)$"
    with pytest.raises(CheckpointError, match=listed):
        streamwise.load_pretrained(pipeline, progress=False)
    with pytest.raises(CheckpointError, match="has no component 'text_encoder' with a config.json; load one"):
        streamwise.load_pretrained(pipeline, component="text_encoder", progress=False)
    model, inputs = tiny_diffusers("vae")
    loaded = streamwise.load_pretrained(pipeline, component="vae", progress=False).model
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).sample, model(**inputs).sample)
    with pytest.raises(CheckpointError, match="this is not one"):
        streamwise.load_pretrained(pipeline / "vae", component="vae", progress=False)
