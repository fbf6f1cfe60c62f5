"""Chat models get their own chat template: the prompt as the user's turn after an optional system turn, the
template's generation prompt after it, as transformers' `apply_chat_template` frames it, from a model folder and from
the GGUF llama.cpp's converter writes (its `tokenizer.chat_template`); off, or without a template, the prompt is
continued as it is, and the node says so."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from streamwise.runtime.checkpoint import load_pretrained, load_tokenizer
from streamwise.runtime.cli.example_models import CHAT_TEMPLATE, GGUF_FILE, TEXT_FOLDER, write_example_models
from streamwise.runtime.generation import PromptError, Sampling, generate_text, prompts

PROMPT = "a cat sat on the mat"
SYSTEM = "answer in one word"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_example_models(root)
    return root


def conversation(system: str = "") -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": PROMPT}]


@pytest.mark.parametrize("system", ["", SYSTEM], ids=["user turn", "system and user turns"])
def test_a_chat_models_prompt_is_framed_by_its_template_as_apply_chat_template_frames_it(models, system):
    folder = models / TEXT_FOLDER
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    expected = tokenizer.apply_chat_template(conversation(system), add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        out = reference.generate(**expected, max_new_tokens=6, do_sample=True, temperature=0.9, top_p=0.9, top_k=40)
    model = load_pretrained(folder).model
    (given,) = prompts(model, load_tokenizer(folder), PROMPT, 6, system=system)
    assert given.chat and given.note is None
    assert torch.equal(given.ids, expected["input_ids"])
    assert tokenizer.decode(given.ids[0]).endswith("<|im_start|>assistant\n")
    text = generate_text(model, given, tokenizer, seed=3, sampling=Sampling("custom", 0.9, 0.9, 40))
    assert text == tokenizer.decode(out[0, expected["input_ids"].shape[1]:], skip_special_tokens=True)


def test_a_llama_cpp_gguf_frames_the_prompt_by_the_template_in_its_metadata(models):
    folder_ids = prompts(load_pretrained(models / TEXT_FOLDER).model, load_tokenizer(models / TEXT_FOLDER), PROMPT, 4,
                         system=SYSTEM)[0].ids
    file = models / GGUF_FILE
    tokenizer = load_tokenizer(file)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    (given,) = prompts(load_pretrained(file).model, tokenizer, PROMPT, 4, system=SYSTEM)
    assert given.chat and torch.equal(given.ids, folder_ids)


def test_chat_off_continues_the_prompt_as_it_is_and_a_system_turn_then_has_no_place(models):
    folder = models / TEXT_FOLDER
    model, tokenizer = load_pretrained(folder).model, load_tokenizer(folder)
    (given,) = prompts(model, tokenizer, PROMPT, 4, chat=False)
    assert not given.chat and torch.equal(given.ids, tokenizer(PROMPT, return_tensors="pt").input_ids)
    with pytest.raises(PromptError, match=r"^system: chat is off, so there is no system turn to put it in"):
        prompts(model, tokenizer, PROMPT, 4, chat=False, system=SYSTEM)


def test_a_model_without_a_template_continues_the_prompt_and_has_no_system_turn(models):
    """Chat is on by default where a model has a template; one without simply continues the prompt."""
    folder = models / TEXT_FOLDER
    model, tokenizer = load_pretrained(folder).model, copy.deepcopy(load_tokenizer(folder))  # kept: never changed
    tokenizer.chat_template = None
    (given,) = prompts(model, tokenizer, PROMPT, 4)
    assert not given.chat and given.note is None
    assert torch.equal(given.ids, tokenizer(PROMPT, return_tensors="pt").input_ids)
    with pytest.raises(PromptError, match=r"^system: the model has no chat template"):
        prompts(model, tokenizer, PROMPT, 4, system=SYSTEM)


def test_a_tokenizer_is_read_once_per_version_of_its_files(models):
    """A GGUF's 150k-token vocabulary takes ~20 s to rebuild, and a host tokenizes once per prompt; an edited folder
    or a re-downloaded file must not tokenize with the old one."""
    for source in (models / TEXT_FOLDER, models / GGUF_FILE):
        first = load_tokenizer(source)
        assert load_tokenizer(source) is first
        changed = source / "tokenizer_config.json" if source.is_dir() else source
        changed.write_bytes(changed.read_bytes())  # the same content, a new file time
        assert load_tokenizer(source) is not first
