"""A checkpoint's own generation settings reach the model `load_pretrained` builds, wherever the checkpoint keeps them:
generation_config.json in a folder or carried in a GGUF Streamwise wrote, llama.cpp's token metadata in its GGUF. Each
model is run beside transformers' `from_pretrained` + `generate`, where a lost setting would change the tokens."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
import transformers

from streamwise.runtime.builders.skeleton import build_skeleton
from streamwise.runtime.checkpoint import CheckpointError, load_pretrained
from streamwise.runtime.checkpoint.generation_defaults import LLAMA_CPP_END_MARKERS
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
from streamwise.runtime.cli import example_models
from streamwise.runtime.generation import Sampling, generate_text, prompts

from helpers import tiny_t5, tiny_tokenizer

PROMPT = "a cat sat on the mat"
LONG = 12


def greedy(model, ids, **settings):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=LONG, do_sample=False, **settings)


def text_model(vocab: int, eos: int):
    """A tiny Qwen2 like the example one, but untied: its greedy tokens vary (the tied one repeats its input)."""
    config = transformers.Qwen2Config(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                      tie_word_embeddings=False, **example_models.TEXT_SIZES)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


def causal_folder(folder, extra_end: bool = False, sample: bool = False):
    """A tiny Qwen2 with the example tokenizer; `extra_end`: its generation_config.json names, beside its end-of-text,
    the third token its greedy output makes (as instruct checkpoints list their end-of-turn token); `sample`: it
    samples by default, with settings of its own."""
    tokens, merges, eos = example_models.bpe_tokenizer_parts()
    model = text_model(len(tokens), eos)
    tokenizer = example_models.fast_tokenizer(tokens, merges, eos)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    made = greedy(model, ids)[0, ids.shape[1]:].tolist()
    assert len(made) == LONG and eos not in made  # the random model never ends by itself
    third = next(token for index, token in enumerate(made) if index >= 2 and token not in made[:index])
    if extra_end:
        model.generation_config.eos_token_id = [eos, third]
    if sample:
        model.generation_config.update(do_sample=True, temperature=1.7, top_k=5, top_p=0.95)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, ids, made.index(third) + 1


def test_an_end_token_in_generation_config_json_stops_generation_as_transformers_does(tmp_path):
    folder, ids, stop = causal_folder(tmp_path / "qwen2", extra_end=True)
    expected = greedy(transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), ids)
    assert expected.shape[1] == ids.shape[1] + stop < ids.shape[1] + LONG  # transformers stops at the second end
    loaded = load_pretrained(folder).model
    assert torch.equal(greedy(loaded, ids), expected)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    (given,) = prompts(loaded, tokenizer, PROMPT, LONG)
    text = generate_text(loaded, given, tokenizer, sampling=Sampling("greedy"))
    assert text == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)


def test_a_checkpoints_own_sampling_is_the_model_default_and_greedy_or_custom_replace_it(tmp_path):
    folder, ids, _ = causal_folder(tmp_path / "sampling", sample=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded = load_pretrained(folder).model
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    (given,) = prompts(loaded, tokenizer, PROMPT, LONG)

    def transformers_text(**flags) -> str:
        torch.manual_seed(11)
        with torch.no_grad():
            out = reference.generate(ids, max_new_tokens=LONG, **flags)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    runs = {mode: generate_text(loaded, given, tokenizer, seed=11, sampling=Sampling(mode, 0.5, 0.8, 3))
            for mode in ("model default", "greedy", "custom")}
    assert runs["model default"] == transformers_text()  # temperature 1.7, top-k 5, as the checkpoint says
    assert runs["greedy"] == transformers_text(do_sample=False)
    assert runs["custom"] == transformers_text(do_sample=True, temperature=0.5, top_p=0.8, top_k=3)
    assert len(set(runs.values())) == 3


def test_a_suppressed_token_in_an_encoder_decoders_generation_config_is_never_made(tmp_path):
    folder = tmp_path / "t5"
    torch.manual_seed(0)
    model, tokenizer = tiny_t5(), tiny_tokenizer()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    first = greedy(model, ids)[0, 1].item()  # after the decoder's start token
    model.generation_config.suppress_tokens = [first]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    expected = greedy(transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval(), ids)
    assert first not in expected[0].tolist()
    assert torch.equal(greedy(load_pretrained(folder).model, ids), expected)


def test_a_gguf_streamwise_wrote_carries_the_settings_it_loads_with(tmp_path):
    folder, ids, stop = causal_folder(tmp_path / "qwen2", extra_end=True)
    file = tmp_path / "carried.gguf"
    quantize_to_gguf(folder, file, "auto", build_skeleton(folder), gguf_type="F32")
    ends = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    (folder / "generation_config.json").unlink()  # read from the file alone
    loaded = load_pretrained(file).model
    assert loaded.generation_config.eos_token_id == ends and len(ends) == 2
    assert greedy(loaded, ids).shape[1] == ids.shape[1] + stop


def test_a_llama_cpp_gguf_ends_at_its_end_of_turn_token_and_at_llama_cpps_end_markers(tmp_path):
    """`eot_token_id` from the metadata, and `<|im_end|>` by its text, as llama.cpp's vocabulary loader does."""
    tokens, merges, eos = example_models.bpe_tokenizer_parts()
    tokens = [*tokens[:-2], "<|im_end|>", "<|eot_id|>"]  # two tokens spelled as end markers, at the vocabulary's end
    model = text_model(len(tokens), eos)
    ids = torch.tensor([[5, 6, 7, 8]])
    made = greedy(model, ids)[0, ids.shape[1]:].tolist()
    turn_end = made[3]
    path = tmp_path / "model.gguf"
    example_models.write_llama_cpp_gguf(model, path, (tokens, merges, eos),
                                        metadata={gguf.Keys.Tokenizer.EOT_ID: turn_end})
    loaded = load_pretrained(path).model
    ends = loaded.generation_config.eos_token_id
    assert sorted(ends) == sorted({eos, turn_end, len(tokens) - 2, len(tokens) - 1})
    assert {tokens[-2], tokens[-1]} <= LLAMA_CPP_END_MARKERS
    assert greedy(loaded, ids).shape[1] == ids.shape[1] + made.index(turn_end) + 1


@pytest.mark.parametrize("content, found", [
    ("{not json", "not a JSON file transformers can read"),
    ("[1, 2]", "holds a list, where a JSON object of settings belongs"),
    (json.dumps({"max_new_tokens": -1}), "`max_new_tokens` must be greater than 0"),  # transformers' validator
    (json.dumps({"eos_token_id": "x"}), "`eos_token_id` is 'x', where token ids are integers"),
    (json.dumps({"suppress_tokens": [3, "4"]}), r"`suppress_tokens` is \[3, '4'\], where token ids are integers"),
])
def test_a_broken_generation_config_json_is_an_error_naming_it_before_anything_loads(tmp_path, content, found):
    folder, _, _ = causal_folder(tmp_path / "broken")
    (folder / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError, match=rf"generation_config\.json: .*{found}"):
        load_pretrained(folder)
