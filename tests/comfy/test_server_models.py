"""Models as they ship, through a real ComfyUI server over HTTP: a checkpoint's own generation settings (an end token
its generation_config.json adds, a token it suppresses) from a folder and from a `.gguf`; chat models in their own
templates with real tokenizers (llama.cpp's vocabulary files for Qwen2, Phi-3 and Gemma, as folders and as GGUFs);
vision-language models of five families given a LoadImage image and a batch of two, each text then encoded by core's
CLIPTextEncode once; a text model given an image refused. Each against transformers' own path."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from streamwise.runtime.builders.skeleton import build_skeleton
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf

from helpers import module_from_file
from llama_cpp_files import float_model, llama_cpp_vocabulary, tokenizer_metadata, write_llama_cpp_gguf
from vision_language import ASKED, FAMILIES, transformers_caption

server_module = module_from_file(Path(__file__).with_name("test_server.py"))
PROMPT = "a cat sat on the mat"
SYSTEM = "Answer in one short sentence."
LONG = 12
IMAGES = ("cat.png", "dog.png")
#: Real tokenizers with their chat templates (llama.cpp's vocabulary files), the family of tiny model each drives, the
#: ends its instruct checkpoints list in generation_config.json, and whether a GGUF of it loads its tokenizer.
CHAT_MODELS = {
    "qwen2": ("qwen2", ["<|endoftext|>", "<|im_end|>"], True),
    "phi-3": ("phi3", ["<|endoftext|>", "<|end|>"], True),
    "gemma-4": ("gemma3_text", ["<eos>", "<turn|>"], False),  # transformers' GGUF reader refuses gemma4's config
}


def untied_qwen2(vocabulary: int, eos: int):
    """A tiny Qwen2 whose greedy tokens vary (a tied one repeats its input)."""
    config = transformers.Qwen2Config(vocab_size=vocabulary, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


def greedy_tokens(model, ids, tokens: int = LONG) -> list[int]:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=tokens, do_sample=False)[0, ids.shape[1]:].tolist()


def end_token_model(models: Path, tokenizer_folder: Path) -> None:
    """`streamwise/end-token-qwen2`: its generation_config.json ends generation also at the third token its greedy
    output makes; and `LLM/end-token-qwen2.gguf`, the same written by `streamwise quantize` (carrying that file)."""
    folder = models / "streamwise" / "end-token-qwen2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    model = untied_qwen2(len(tokenizer), tokenizer.eos_token_id)
    made = greedy_tokens(model, tokenizer(PROMPT, return_tensors="pt").input_ids)
    third = next(token for index, token in enumerate(made) if index >= 2 and token not in made[:index])
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, third]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    quantize_to_gguf(folder, models / "LLM" / "end-token-qwen2.gguf", "auto", build_skeleton(folder),
                     gguf_type="F32")


def suppressing_t5(models: Path, tokenizer_folder: Path) -> None:
    """`streamwise/suppress-t5`: its generation_config.json suppresses the first token its greedy output makes."""
    folder = models / "streamwise" / "suppress-t5"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    config = transformers.T5Config(vocab_size=len(tokenizer), d_model=64, d_ff=128, num_layers=2, num_heads=4,
                                   d_kv=16, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        first = model.generate(tokenizer(PROMPT, return_tensors="pt").input_ids, max_new_tokens=2)[0, 1].item()
    model.generation_config.suppress_tokens = [first]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def chat_model(models: Path, name: str) -> None:
    """`streamwise/<name>-chat`: a tiny model driven by llama.cpp's real `<name>` tokenizer and chat template, with the
    ends its instruct checkpoints list; where its tokenizer loads from a GGUF, `LLM/<name>-chat.gguf` too, the same
    weights as llama.cpp's converter writes them (F32 matrices, a Q8_0 embedding) with that tokenizer's metadata, and
    `streamwise/<name>-chat-gguf-reference`, the float model the file holds."""
    family, ends, gguf_tokenizer = CHAT_MODELS[name]
    vocabulary = llama_cpp_vocabulary(name)
    tokenizer_class = transformers.GemmaTokenizerFast if family.startswith("gemma") else transformers.AutoTokenizer
    tokenizer = tokenizer_class.from_pretrained(vocabulary.parent, gguf_file=vocabulary.name)
    model = float_model(family, len(tokenizer), tokenizer.eos_token_id)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(ends)
    folder = models / "streamwise" / f"{name}-chat"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if gguf_tokenizer:
        rounded = write_llama_cpp_gguf(model, models / "LLM" / f"{name}-chat.gguf", family,
                                       gguf.GGMLQuantizationType.F32, None, metadata=tokenizer_metadata(vocabulary))
        rounded.generation_config = model.generation_config
        rounded.save_pretrained(models / "streamwise" / f"{name}-chat-gguf-reference")
        tokenizer.save_pretrained(models / "streamwise" / f"{name}-chat-gguf-reference")


@pytest.fixture(scope="module")
def server(comfy_root, tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-base")
    paths = server_module.prepared(comfy_root, base)
    models, example = base / "models", base / "models" / "streamwise" / "tiny-qwen2"
    end_token_model(models, example)
    suppressing_t5(models, example)
    for name in CHAT_MODELS:
        chat_model(models, name)
    for family, write in FAMILIES.items():
        write(models / "streamwise" / f"vlm-{family}")
    generator = np.random.default_rng(0)
    for name in IMAGES:  # one size: a batch node stacks them as they are
        Image.fromarray((generator.random((40, 30, 3)) * 255).astype(np.uint8)).save(base / "input" / name)
    with server_module.launched(comfy_root, base, paths) as started:
        yield started


def models_of(server) -> Path:
    return server.log.parent / "models"


def text_graph(model: str, prompt: str, tokens: int = LONG, **inputs) -> dict:
    graph = server_module.workflow("streamwise_generate_text")
    graph["1"]["inputs"]["model"] = model
    graph["2"]["inputs"].update(prompt=prompt, system="", chat=False, max_new_tokens=tokens, sampling="greedy")
    graph["2"]["inputs"].update(inputs)
    return graph


def texts(server, graph: dict, node: str = "2") -> list[str]:
    return server.run(graph)["outputs"][node]["text"]


def transformers_text(folder: Path, ids: torch.Tensor, tokens: int = LONG, seed: int = 0, **flags) -> str:
    """transformers' own: `from_pretrained` with its generation_config.json, `generate` with `flags`."""
    reference = transformers.AutoModelForSeq2SeqLM if "t5" in folder.name else transformers.AutoModelForCausalLM
    model = reference.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, **flags)
    made = out[0] if model.config.is_encoder_decoder else out[0, ids.shape[1]:]
    return tokenizer.decode(made, skip_special_tokens=True)


SAMPLINGS = {"greedy": dict(do_sample=False), "custom": dict(do_sample=True, temperature=1.5, top_p=0.95, top_k=40)}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("model", ["streamwise/end-token-qwen2", "LLM/end-token-qwen2.gguf", "streamwise/suppress-t5"])
def test_a_checkpoints_end_and_suppressed_tokens_hold_as_transformers_holds_them(server, model, sampling):
    folder = models_of(server) / "streamwise" / Path(model).stem
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = transformers_text(folder, ids, seed=5, **SAMPLINGS[sampling])
    graph = text_graph(model, PROMPT, seed=5, sampling=sampling, temperature=1.5, top_p=0.95, top_k=40)
    assert texts(server, graph) == [expected]
    if "qwen2" in model and sampling == "greedy":  # it stopped at the second end token, where 12 were allowed
        assert len(tokenizer(expected).input_ids) < LONG
        assert transformers_text(folder, ids, eos_token_id=tokenizer.eos_token_id) != expected


@pytest.mark.parametrize("model", [
    *(f"streamwise/{name}-chat" for name in CHAT_MODELS),
    *(f"LLM/{name}-chat.gguf" for name, (_, _, gguf_tokenizer) in CHAT_MODELS.items() if gguf_tokenizer),
])
def test_a_chat_model_answers_in_its_own_template(server, model):
    """The node's text equals `apply_chat_template` (system and user turns, generation prompt) + `generate` with the
    checkpoint's own ends; a GGUF beside the float model its file holds, its template and ends from its metadata."""
    name = Path(model).stem
    folder = models_of(server) / "streamwise" / (f"{name}-gguf-reference" if model.endswith(".gguf") else name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    expected = transformers_text(folder, ids, tokens=8, do_sample=False)
    graph = text_graph(model, PROMPT, tokens=8, system=SYSTEM, chat=True, sampling="model default")
    assert texts(server, graph) == [expected]
    raw = transformers_text(folder, tokenizer(PROMPT, return_tensors="pt").input_ids, tokens=8, do_sample=False)
    assert texts(server, text_graph(model, PROMPT, tokens=8)) == [raw]  # chat off: continued as it is


def caption_graph(model: str, prompt: str, images: tuple[str, ...], encode: bool = False) -> dict:
    """The shipped caption workflow: LoadImage (two through core's ImageBatch) -> Generate Text, then, with `encode`,
    each text through CLIPTextEncode into a Preview Any (an output node, so the encoder runs)."""
    graph = server_module.workflow("streamwise_caption_image")
    graph["2"]["inputs"]["model"] = model
    graph["3"]["inputs"].update(prompt=prompt, max_new_tokens=8)
    graph["1"]["inputs"]["image"] = images[0]
    if encode:
        graph["8"] = {"class_type": "PreviewAny", "inputs": {"source": ["5", 0]}}
    else:
        del graph["4"], graph["5"]
    if len(images) == 2:
        graph["6"] = {"class_type": "LoadImage", "inputs": {"image": images[1]}}
        graph["7"] = {"class_type": "ImageBatch", "inputs": {"image1": ["1", 0], "image2": ["6", 0]}}
        graph["3"]["inputs"]["image"] = ["7", 0]
    return graph


def caption(server, family: str, image: str) -> str:
    """transformers' caption of one of the server's input images by `vlm-<family>`."""
    picture = Image.open(server.log.parent / "input" / image).convert("RGB")
    return transformers_caption(models_of(server) / "streamwise" / f"vlm-{family}", picture, ASKED[family], 8)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_vision_language_model_captions_a_loaded_image_as_transformers_does(server, family):
    graph = caption_graph(f"streamwise/vlm-{family}", ASKED[family], IMAGES[:1])
    assert texts(server, graph, "3") == [caption(server, family, IMAGES[0])]


def test_each_image_of_a_batch_gets_its_caption_and_the_text_encoder_runs_once_per_caption(server):
    expected = [caption(server, "florence2", image) for image in IMAGES]
    entry = server.run(caption_graph("streamwise/vlm-florence2", "<CAPTION>", IMAGES, encode=True))
    assert expected[0] != expected[1] and entry["outputs"]["3"]["text"] == expected
    assert len(entry["outputs"]["8"]["text"]) == 2  # CLIPTextEncode, and what shows its output, once per caption


def test_a_text_model_given_an_image_is_refused_naming_the_model_and_the_input(server):
    graph = caption_graph("streamwise/tiny-qwen2", PROMPT, IMAGES[:1])
    entry = server.wait(server.queue(graph))
    (error,) = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert error["node_type"] == "StreamwiseGenerateText" and error["exception_type"].endswith("PromptError")
    assert error["exception_message"].startswith("image: Qwen2ForCausalLM (`qwen2`) is a text-only model and takes "
                                                 "no image")
