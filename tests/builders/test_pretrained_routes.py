"""Which class `load_pretrained` builds: the one the config names (`config.architectures`), else transformers' task
mappings in a fixed order, or the class the caller asks for; the load report says which and why."""

from __future__ import annotations

import json
import logging

import gguf
import pytest
import torch
from torch import nn

import streamwise
from streamwise.runtime.builders.model_spec import ModelSpecError, build_model
from streamwise.runtime.checkpoint.readers import CheckpointError

from helpers import tiny_qwen2, tiny_sample, tiny_vision_language
from llama_cpp_files import float_model, train_tokenizer_parts, write_llama_cpp_gguf

transformers = pytest.importorskip("transformers")


def saved(tmp_path, family: str):
    model, inputs = tiny_vision_language() if family == "vision-language" else tiny_sample(family)
    model.eval().save_pretrained(tmp_path)
    return model, inputs


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


@pytest.mark.parametrize("family, built", [
    ("audio", "WhisperForConditionalGeneration"), ("vision-language", "Qwen2_5_VLForConditionalGeneration"),
])
def test_the_class_the_config_names_is_built(tmp_path, caplog, family, built):
    model, inputs = saved(tmp_path, family)
    with caplog.at_level(logging.INFO, logger="streamwise.load"):
        loaded, report, chosen = streamwise.load_pretrained(tmp_path, "transformers", progress=False)
    assert isinstance(loaded, getattr(transformers, built))
    assert report.built == f"{built} (config.architectures)" and str(report).startswith(f"built {built} (config.")
    assert f"load_pretrained: {tmp_path.name}: built {report.built}; {chosen}" in caplog.messages
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def test_where_the_config_names_no_class_the_task_mappings_decide(tmp_path):
    from streamwise.runtime.builders.skeleton import built_skeleton

    saved(tmp_path / "whisper", "audio")
    edit_config(tmp_path / "whisper", architectures=None)
    assert built_skeleton(tmp_path / "whisper").how == "WhisperForCausalLM (task mapping: causal LM)"
    edit_config(tmp_path / "whisper", architectures=["MyWhisper"])  # remote code transformers does not have
    assert built_skeleton(tmp_path / "whisper").how == (
        "WhisperForCausalLM (task mapping: causal LM; config.architectures ['MyWhisper'] names no transformers class "
        "for it)")
    saved(tmp_path / "vl", "vision-language")
    edit_config(tmp_path / "vl", architectures=None)  # no causal-LM class: the image-text-to-text one
    assert built_skeleton(tmp_path / "vl").how == (
        "Qwen2_5_VLForConditionalGeneration (task mapping: image/audio-text-to-text)")


def test_the_caller_names_another_class(tmp_path):
    model, inputs = saved(tmp_path, "audio")
    edit_config(tmp_path, architectures=None)  # the decoder alone would be built, and the encoder's weights refused
    with pytest.raises(CheckpointError, match="not in the model"):
        streamwise.load_pretrained(tmp_path, "transformers", progress=False)
    for asked in ("WhisperForConditionalGeneration", transformers.WhisperForConditionalGeneration):
        loaded, report, _ = streamwise.load_pretrained(tmp_path, "transformers", model_class=asked, progress=False)
        assert report.built == "WhisperForConditionalGeneration (asked for)"
        with torch.no_grad():
            assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def test_the_base_model_loads_from_a_task_models_folder(tmp_path):
    """The file's keys carry the task model's `model.` prefix, stripped as `from_pretrained` strips it."""
    model, inputs = saved(tmp_path, "audio")
    base, report, _ = streamwise.load_pretrained(tmp_path, "transformers", model_class="WhisperModel", progress=False)
    assert isinstance(base, transformers.WhisperModel) and report.built == "WhisperModel (asked for)"
    with torch.no_grad():
        assert torch.equal(base(**inputs).last_hidden_state, model.model(**inputs).last_hidden_state)


@pytest.mark.parametrize("asked, message", [
    ("WhisperModle", "transformers has no model class `WhisperModle`; did you mean `WhisperModel`?"),
    ("WhisperConfig", "transformers has no model class `WhisperConfig`"),
    (nn.Linear, "`model_class` must be a transformers model class or its name, not <class"),
    (transformers.PreTrainedModel, "`model_class` must be a transformers model class"),  # builds from no config
    ("UNet2DConditionModel", "transformers has no model class `UNet2DConditionModel`"),  # a transformers folder
])
def test_a_class_that_cannot_be_asked_for_is_named(tmp_path, asked, message):
    saved(tmp_path, "audio")
    with pytest.raises(ModelSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        streamwise.load_pretrained(tmp_path, "transformers", model_class=asked)


def test_a_class_whose_code_refuses_the_config_says_which(tmp_path):
    saved(tmp_path, "audio")
    with pytest.raises(ModelSpecError, match="transformers cannot build `Qwen2ForCausalLM` from this WhisperConfig"):
        streamwise.load_pretrained(tmp_path, "transformers", model_class="Qwen2ForCausalLM")


def test_a_llama_cpp_gguf_has_no_architectures_and_builds_its_causal_lm(tmp_path):
    parts = train_tokenizer_parts()
    path = tmp_path / "tiny.gguf"
    write_llama_cpp_gguf(float_model("llama", len(parts[0]), parts[2]), path, "llama",
                         gguf.GGMLQuantizationType.Q8_0, parts)
    model, report, _ = streamwise.load_pretrained(path, "transformers", progress=False)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert report.built == "LlamaForCausalLM (task mapping: causal LM)"


@pytest.mark.parametrize("spec, built", [
    ("transformers:whisper", "WhisperForCausalLM"), ("transformers:qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("transformers:t5", "T5ForConditionalGeneration"), ("transformers:bert", "BertLMHeadModel"),
])
def test_a_model_type_spec_builds_by_the_task_mappings(spec, built):
    """`policy-validate --model transformers:<model_type>`: a default config (full size, on meta) names no class."""
    assert type(build_model(spec)).__name__ == built


def test_a_folder_without_tokenizer_files_says_so_not_which_library_to_install(tmp_path):
    from streamwise.runtime.checkpoint import load_tokenizer

    tiny_qwen2().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds no tokenizer files \(any of tokenizer\.json, .*\): copy the "
                                         r"model's tokenizer files beside its weights"):
        load_tokenizer(tmp_path)
