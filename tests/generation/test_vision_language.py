"""Images into vision-language models: each family `auto` loads, from a folder as `save_pretrained` writes it, given an
image through its own processor, generates what transformers' processor + `generate` does, streamed or resident; a
model that takes no image, a raw prompt without the image's token and a checkpoint that needs its own code are
refused, each saying what to do."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file

from streamwise.runtime.builders.model_spec import ModelSpecError
from streamwise.runtime.checkpoint import load_pretrained, load_tokenizer
from streamwise.runtime.generation import PromptError, Sampling, generate_text, load_processor, prompts

from helpers import force_streaming
from vision_language import ASKED, FAMILIES, transformers_inputs

GREEDY = Sampling("greedy")


@pytest.fixture(scope="module")
def image():
    return Image.fromarray((np.random.default_rng(0).random((40, 30, 3)) * 255).astype(np.uint8))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_vision_language_model_given_an_image_generates_what_transformers_does(family, tmp_path, image):
    folder = FAMILIES[family](tmp_path / family)
    processor, tokenizer = load_processor(folder), load_tokenizer(folder)
    text = ASKED[family]
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    inputs = transformers_inputs(processor, image, text)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=8, do_sample=False)
    made = out[0] if reference.config.is_encoder_decoder else out[0, inputs["input_ids"].shape[1]:]
    expected = tokenizer.decode(made, skip_special_tokens=True)
    model = load_pretrained(folder, "auto").model
    (given,) = prompts(model, tokenizer, text, 8, images=[image], processor=processor)
    assert given.chat is (processor.chat_template is not None) and given.image
    assert given.inputs.keys() == inputs.keys()
    assert all(torch.equal(given.inputs[name], inputs[name]) for name in inputs)
    assert generate_text(model, given, tokenizer, sampling=GREEDY) == expected
    force_streaming(model)  # every streamed leaf fetches its weights, as under a partial load
    assert generate_text(model, given, tokenizer, sampling=GREEDY) == expected


def test_each_image_of_a_batch_gets_its_own_text(tmp_path, image):
    folder = FAMILIES["llava"](tmp_path / "llava")
    processor, tokenizer = load_processor(folder), load_tokenizer(folder)
    model = load_pretrained(folder, "auto").model
    flipped = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    given = prompts(model, tokenizer, "describe", 8, images=[image, flipped], processor=processor)
    alone = [prompts(model, tokenizer, "describe", 8, images=[each], processor=processor)[0] for each in
             (image, flipped)]
    texts = [generate_text(model, each, tokenizer, sampling=GREEDY) for each in given]
    assert texts == [generate_text(model, each, tokenizer, sampling=GREEDY) for each in alone]
    assert texts[0] != texts[1]


def test_a_text_model_given_an_image_is_refused_naming_the_model_and_the_input(tmp_path, image):
    from streamwise.runtime.cli.example_models import write_example_models

    write_example_models(tmp_path)
    folder = tmp_path / "streamwise" / "tiny-qwen2"
    model, tokenizer = load_pretrained(folder).model, load_tokenizer(folder)
    with pytest.raises(PromptError, match=r"^image: Qwen2ForCausalLM \(`qwen2`\) is a text-only model and takes no "
                                          r"image"):
        prompts(model, tokenizer, "describe", 8, images=[image])


def test_a_raw_prompt_without_the_image_token_is_refused_saying_where_the_token_goes(tmp_path, image):
    folder = FAMILIES["llava"](tmp_path / "llava")
    processor, tokenizer = load_processor(folder), load_tokenizer(folder)
    model = load_pretrained(folder, "auto").model
    with pytest.raises(PromptError, match=r"^image: the model's processor refuses .* the prompt must hold the "
                                          r"model's image token"):
        prompts(model, tokenizer, "describe", 8, chat=False, images=[image], processor=processor)
    (given,) = prompts(model, tokenizer, "USER: <image>\ndescribe ASSISTANT:", 8, chat=False, images=[image],
                       processor=processor)
    assert not given.chat and generate_text(model, given, tokenizer, sampling=GREEDY)


def test_a_checkpoint_written_for_its_own_code_is_refused_naming_the_native_one(tmp_path):
    """The original Florence-2 checkpoints: `model_type` florence2, which transformers now ships, in the layout of
    their own code, which transformers' class does not read."""
    folder = tmp_path / "Florence-2-base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Florence2ForConditionalGeneration"], "model_type": "florence2",
        "auto_map": {"AutoConfig": "configuration_florence2.Florence2Config",
                     "AutoModelForCausalLM": "modeling_florence2.Florence2ForConditionalGeneration"},
        "text_config": {"model_type": "florence2_language", "d_model": 32},
        "vision_config": {"model_type": "davit", "depths": [1]},
    }))
    save_file({"language_model.lm_head.weight": torch.zeros(4, 4)}, folder / "model.safetensors")
    with pytest.raises(ModelSpecError, match=r"config\.json: written for the model's own code \(`auto_map` maps "
                                             r"`AutoConfig` to `configuration_florence2\.Florence2Config`\).*never "
                                             r"runs a folder's code.*florence-community/Florence-2-base"):
        load_pretrained(folder)
