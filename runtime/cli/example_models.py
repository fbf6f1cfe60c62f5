"""`streamwise example-models DIR`: the tiny models the shipped workflows name, written into a ComfyUI models folder.

- `streamwise/tiny-qwen2`: a transformers Qwen2 folder as `save_pretrained` writes it, with its tokenizer, laid out as
  an instruct checkpoint ships: ChatML turn tokens, Qwen2's chat template, and a generation_config.json that ends
  generation at the end of a turn as well as at the end of text;
- `LLM/tiny-qwen2.Q8_0.gguf`: the same model as llama.cpp's converter writes it (architecture `qwen2`, matrices in
  Q8_0, the tokenizer and chat template in its metadata), loadable with no `config.json`;
- `streamwise/tiny-vibevoice`: a transformers VibeVoice folder (model, processor with its chat template, generation
  config), the layout the published checkpoints have;
- `streamwise/tiny-florence2`: a captioner, transformers' native Florence-2 with its processor (task prompts such as
  `<CAPTION>`), as `save_pretrained` writes it.

Weights are random from a fixed seed: the models run every node and workflow, fast, offline, and say nothing.
The tokenizers are trained here on a few sentences, so nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

TEXT_FOLDER = "streamwise/tiny-qwen2"
GGUF_FILE = "LLM/tiny-qwen2.Q8_0.gguf"
SPEECH_FOLDER = "streamwise/tiny-vibevoice"
CAPTION_FOLDER = "streamwise/tiny-florence2"
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, streaming weights", "a tiny model says hi",
          "a cat sat on the mat"]
TEXT_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
# VibeVoice's prompt layout (a voice section for speakers that bring a recording, then the script, then the start of
# speech), as a chat template for the tiny processor.
VIBEVOICE_TEMPLATE = (
    "{{- ' Transform the text provided by various speakers into speech output.\\n' -}}"
    "{%- set ns = namespace(voiced=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] | selectattr('type', 'equalto', 'audio') | list"
    " and message['role'] not in ns.voiced -%}{%- set ns.voiced = ns.voiced + [message['role']] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.voiced -%}{{- ' Voice input:\\n' -}}{%- for speaker in ns.voiced -%}"
    "{{- ' Speaker ' ~ speaker ~ ':<|vision_start|><|vision_pad|><|vision_end|>\\n' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- ' Text input:\\n' -}}"
    "{%- for message in messages -%}{%- for item in message['content'] | selectattr('type', 'equalto', 'text') -%}"
    "{{- ' Speaker ' ~ message['role'] ~ ': ' ~ item['text'] ~ '\\n' -}}"
    "{%- endfor -%}{%- endfor -%}"
    "{{- ' Speech output:\\n<|vision_start|>' -}}"
)
TURN_TOKENS = ("<|im_start|>", "<|im_end|>")
"""ChatML's turn markers, which Qwen2's chat template writes around each message."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Qwen2-Instruct's chat template, as its tokenizer_config.json ships it."""
AUDIBLE = 3e3
"""How much the tiny VibeVoice's last decoder layer is scaled: its noise then peaks near 0.3, well within a 16-bit
FLAC (at init it is near 1e-5)."""


def write_example_models(models: str | Path) -> list[Path]:
    """Write the example models under `models` (a ComfyUI `models` folder); returns what was written."""
    models = Path(models)
    tokens, merges, eos = bpe_tokenizer_parts(TURN_TOKENS)
    text = tiny_text_model(len(tokens), eos)
    text.generation_config.eos_token_id = [eos, tokens.index("<|im_end|>")]  # as Qwen2-Instruct's lists them
    folder = models / TEXT_FOLDER
    text.save_pretrained(folder)
    fast_tokenizer(tokens, merges, eos, CHAT_TEMPLATE).save_pretrained(folder)
    gguf_path = models / GGUF_FILE
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    write_llama_cpp_gguf(text, gguf_path, (tokens, merges, eos), metadata={"tokenizer.chat_template": CHAT_TEMPLATE})
    return [folder, gguf_path, tiny_vibevoice_folder(models / SPEECH_FOLDER),
            tiny_florence2_folder(models / CAPTION_FOLDER)]


def bpe_tokenizer_parts(specials: tuple[str, ...] = ()) -> tuple[list[str], list[str], int]:
    """A byte-level BPE trained here (offline), as llama.cpp's `gpt2` tokenizer metadata holds one: tokens by id,
    merges, and the id of its end-of-text control token; `specials` are more control tokens, after it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", *specials], show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    return tokens, merges, tokens.index("<|endoftext|>")


def fast_tokenizer(tokens: list[str], merges: list[str], eos: int, chat_template: str | None = None):
    """The transformers tokenizer of those parts (what a model folder's `tokenizer.json` holds), the control tokens
    (`<|...|>`) special, with `chat_template` where given."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    bpe = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)},
                               merges=[tuple(merge.split(" ")) for merge in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    end = tokens[eos]
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=end, pad_token=end, bos_token=end,
        additional_special_tokens=[token for token in tokens if _is_control(token) and token != end])
    tokenizer.chat_template = chat_template
    return tokenizer


def _is_control(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")


def tiny_text_model(vocab: int, eos: int):
    """A tiny Qwen2 (tied embeddings, as llama.cpp's converter expects of Qwen2) from seed 0."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                      tie_word_embeddings=True, **TEXT_SIZES)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


def write_llama_cpp_gguf(model, path: str | Path, tokenizer_parts: tuple[list[str], list[str], int] | None,
                         qtype=None, transform: Callable | None = None, *, architecture=None,
                         extra: dict | None = None, metadata: dict[str, object] | None = None) -> None:
    """Write a transformers decoder as llama.cpp's `convert_hf_to_gguf.py` does: its architecture's tensor names
    and metadata, matrices quantized to `qtype` (default Q8_0; the token embedding always Q8_0, as llama.cpp's
    presets keep it), 1-D tensors in F32, a tied head left out, and the tokenizer in the metadata. `transform(name,
    array, config)` is the converter's per-architecture change of a tensor (Llama's Q/K permutation), if any;
    `architecture` a `gguf.MODEL_ARCH` (default: the one named like the config's `model_type`); `extra` more tensors
    to write as they are, by GGUF name; `metadata` more keys (an integer as uint32, a float as float32, a list as an
    array of its items' type), such as `tokenizer.ggml.eot_token_id` or `tokenizer.chat_template`, or a whole
    tokenizer where `tokenizer_parts` is None (another GGUF's `tokenizer.*` keys)."""
    import gguf
    import numpy as np

    config = model.config
    arch = architecture if architecture is not None else gguf.MODEL_ARCH[config.model_type.upper()]
    qtype = gguf.GGMLQuantizationType.Q8_0 if qtype is None else qtype
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention", rope) if isinstance(rope, dict) else rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if tokenizer_parts is not None:
        tokens, merges, eos = tokenizer_parts
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if _is_control(token) else 1 for token in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(eos)
        writer.add_eos_token_id(eos)
        writer.add_pad_token_id(eos)
    for key, value in (metadata or {}).items():
        add = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
        (writer.add_array if isinstance(value, list) else add[type(value)])(key, value)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # the converter skips a tied head
        data = tensor.float().numpy()
        data = (transform(name, data, config) if transform is not None else data).astype(np.float32)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"llama.cpp's `{arch.name.lower()}` layout has no name for `{name}`")
        if data.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0 if gguf_name == "token_embd.weight" else qtype
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, data)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_vibevoice():
    """transformers' VibeVoiceForConditionalGeneration at toy size (LM, tokenizers, diffusion head)."""
    import transformers

    text = dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    audio = dict(model_type="vibevoice_acoustic_tokenizer", hidden_size=8, num_filters=4, downsampling_ratios=[2, 2],
                 depths=[1, 1, 1], kernel_size=3, layer_scale_init_value=0.5)
    semantic = dict(audio, model_type="vibevoice_acoustic_tokenizer_encoder")
    head = dict(model_type="vibevoice_diffusion", hidden_size=32, latent_size=8, head_layers=1, intermediate_size=64)
    config = transformers.VibeVoiceConfig(
        text_config=text, audio_config=audio, semantic_model_config=semantic, diffusion_head_config=head,
        pad_token_id=0, eos_token_id=1, audio_bos_token_id=2, audio_eos_token_id=3, audio_token_id=4,
    )
    return transformers.VibeVoiceForConditionalGeneration(config).eval()


def tiny_vibevoice_folder(folder: str | Path) -> Path:
    """A VibeVoice folder as the real libraries save one: `tiny_vibevoice`'s weights, a word-level tokenizer whose
    special tokens sit at the config's ids, VibeVoice's feature extractor at the tiny tokenizer's hop (4 samples a
    frame), the chat template, and a generation config under which the random model never ends speech early (it
    masks end-of-text and the audio start/end tokens), so every run makes exactly max_new_tokens frames."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = Path(folder)
    special = ["[PAD]", "[EOS]", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "[UNK]"]  # ids 0..5
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "Speaker 0 1 2 3 : . , Transform text speech output Voice Text Speech input hello there how are you"
    tokenizer.train_from_iterator([words], trainers.WordLevelTrainer(vocab_size=64, special_tokens=special))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
        additional_special_tokens=special[2:5],
    )
    torch.manual_seed(0)
    model = tiny_vibevoice()
    with torch.no_grad():
        model.model.audio_tower.decoder.head.conv.weight.mul_(AUDIBLE)
        model.model.audio_tower.decoder.head.conv.bias.mul_(AUDIBLE)
    hop = math.prod(model.config.audio_config.downsampling_ratios)
    extractor = transformers.VibeVoiceAcousticTokenizerFeatureExtractor(pad_to_multiple_of=hop)
    transformers.VibeVoiceProcessor(extractor, fast, chat_template=VIBEVOICE_TEMPLATE).save_pretrained(folder)
    model.generation_config.suppress_tokens = [model.config.eos_token_id, model.config.audio_bos_token_id,
                                               model.config.audio_eos_token_id]
    model.save_pretrained(folder)
    return folder


def special_tokenizer(specials: list[str], padding_side: str = "left", **roles: str):
    """The house byte-level BPE with `specials` added after its 320 entries, in order (so their ids are fixed);
    `roles` names some of them: `bos_token`, `eos_token`, `pad_token`, and model-specific ones (`image_token`...),
    which become attributes with an `_id` as the published tokenizer configs declare them. Specials that are no
    standard role are extra special tokens: skipped when decoding with `skip_special_tokens`. Padding is on the left
    for a decoder, so that a batch of prompts generates as each alone does (an encoder's goes right)."""
    import transformers
    from tokenizers import AddedToken

    tokens, merges, eos = bpe_tokenizer_parts()
    bpe = fast_tokenizer(tokens, merges, eos).backend_tokenizer
    bpe.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    standard = {role: token for role, token in roles.items() if role in ("bos_token", "eos_token", "pad_token")}
    extra = [token for token in specials if token not in standard.values()]
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, extra_special_tokens=extra,
                                                padding_side=padding_side, **roles)


def spread_weights(language_model, std: float = 0.4) -> None:
    """Re-draw a tied-embedding decoder's matrices and embeddings at `std`: at the init's 0.02 the tied embedding
    outweighs the layers, so the random model repeats its last input token (PaliGemma's newline, Florence-2's
    end of text, which ends generation at once), and greedy runs would compare nothing."""
    with torch.no_grad():
        for parameter in language_model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, std)


def token_ids(tokenizer, **roles: str) -> dict[str, int]:
    """Config entries (`image_token_id=...`) holding the ids of the tokenizer's tokens (`"<image>"`)."""
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in roles.items()}


def tiny_florence2_folder(folder: str | Path) -> Path:
    """Florence-2 (transformers' own `Florence2ForConditionalGeneration`, no remote code: a DaViT tower, a BART
    encoder-decoder; `Florence2Processor`): 32x32 images through two DaViT stages (strides 4, 2) give 4x4 features
    and their mean, 17 image tokens."""
    import transformers as T

    tokenizer = special_tokenizer(["<s>", "<pad>", "</s>", "<unk>", "<image>"], padding_side="right",
                                  bos_token="<s>", eos_token="</s>", pad_token="<pad>", image_token="<image>")
    roles = token_ids(tokenizer, bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>")
    text = dict(model_type="bart", vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                max_position_embeddings=256, decoder_start_token_id=roles["eos_token_id"],
                forced_eos_token_id=roles["eos_token_id"], **roles)
    vision = dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                  patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[1, 2], num_groups=[1, 2],
                  window_size=4, projection_dim=32, drop_path_rate=0.0)
    config = T.Florence2Config(text_config=text, vision_config=vision,
                               **token_ids(tokenizer, image_token_id="<image>"))
    torch.manual_seed(0)
    model = T.Florence2ForConditionalGeneration(config)
    spread_weights(model.model.language_model)
    images = T.CLIPImageProcessor(size={"height": 32, "width": 32}, crop_size={"height": 32, "width": 32},
                                  do_center_crop=False, image_seq_length=17)
    return save_with_processor(folder, model, T.Florence2Processor(image_processor=images, tokenizer=tokenizer))


def save_with_processor(folder: str | Path, model, processor) -> Path:
    """The model and its processor, each by its own `save_pretrained`."""
    folder = Path(folder)
    model.eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
