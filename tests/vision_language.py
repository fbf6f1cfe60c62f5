"""Tiny vision-language model folders as `save_pretrained` writes them: the model and its processor (tokenizer,
image processor, chat template where the family has one), for tests that run a family end to end from its folder.

Each `write_<family>(folder)` builds transformers' native class at toy size from seed 0 (hidden sizes 32-64, one or
two layers) and saves it with the processor the published checkpoints ship, configured so that an image of any size
gives a few image tokens. The tokenizer is the house byte-level BPE (`example_models.bpe_tokenizer_parts`, trained
offline) with the family's special tokens added after it, so any prompt encodes and nothing is downloaded; the
model's vocabulary is the tokenizer's length, so every generated id decodes.

How each family is prompted (`prompt`): Qwen2-VL, LLaVA and SmolVLM by their chat template with an
`{"type": "image"}` content item; PaliGemma by a plain prefix (its processor puts the image tokens and BOS before
it); Florence-2 by a task token such as `<CAPTION>` (its processor expands it to the task's question).

Without torchvision (the project never installs it) transformers 5 cannot build Qwen2-VL's or SmolVLM's processor:
both have a video slot, and every video processor needs torchvision. Their folders hold the processor's parts
(`_save_parts`): `AutoTokenizer` and `AutoImageProcessor` load them here; `AutoProcessor` gets as far as the video
processor, which it takes from the image processor's settings, so it should load them where torchvision is installed
(SmolVLM's also needs `num2words`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from streamwise.runtime.cli.example_models import (
    save_with_processor,
    special_tokenizer,
    spread_weights,
    tiny_florence2_folder,
    token_ids,
)

SEED = 0

# Qwen2-VL's published chat template (Qwen/Qwen2-VL-2B-Instruct): a default system turn, images and videos as
# vision-start/pad/end, the assistant's turn opened by `add_generation_prompt`.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# LLaVA 1.5's (llava-hf/llava-1.5-7b-hf): `USER: <image>\n... ASSISTANT:`.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# SmolVLM's (HuggingFaceTB/SmolVLM-256M-Instruct): `<|im_start|>User:<image>...<end_of_utterance>\nAssistant:`.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def write_qwen2_vl(folder: Path) -> Path:
    """Qwen2-VL (`Qwen2VLForConditionalGeneration`, `Qwen2VLProcessor`): 4-pixel patches merged 2x2 and the image
    processor's pixel range 16x16..32x32, so an image gives 4 to 16 image tokens. Saved in parts (`_save_parts`)."""
    import transformers as T

    tokenizer = special_tokenizer(["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                            "<|video_pad|>"], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                           image_token="<|image_pad|>", video_token="<|video_pad|>")
    roles = token_ids(tokenizer, bos_token_id="<|endoftext|>", eos_token_id="<|im_end|>", pad_token_id="<|endoftext|>")
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}, **roles)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = T.Qwen2VLConfig(text_config=text, vision_config=vision,
                             **token_ids(tokenizer, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                                    vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>"))
    torch.manual_seed(SEED)
    model = T.Qwen2VLForConditionalGeneration(config)
    images = T.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2,
                                     min_pixels=16 * 16, max_pixels=32 * 32)
    return _save_parts(folder, model, "Qwen2VLProcessor", images, tokenizer, QWEN2_VL_TEMPLATE)


def write_llava(folder: Path) -> Path:
    """LLaVA 1.5 (`LlavaForConditionalGeneration` with a CLIP tower, `LlavaProcessor`): 32x32 images in 8-pixel
    patches, the CLS feature dropped (`default`), so 16 image tokens."""
    import transformers as T

    tokenizer = special_tokenizer(["<s>", "</s>", "<unk>", "<image>"], bos_token="<s>", eos_token="</s>",
                           pad_token="<unk>", image_token="<image>")
    text = T.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         **token_ids(tokenizer, bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<unk>"))
    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=8, projection_dim=32)
    config = T.LlavaConfig(text_config=text, vision_config=vision, image_seq_length=16,
                           **token_ids(tokenizer, image_token_index="<image>"))
    torch.manual_seed(SEED)
    model = T.LlavaForConditionalGeneration(config)
    images = T.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = T.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                 vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                 chat_template=LLAVA_TEMPLATE)
    return save_with_processor(folder, model, processor)


def write_smolvlm(folder: Path) -> Path:
    """SmolVLM (`SmolVLMForConditionalGeneration`, Idefics3's layout; `SmolVLMProcessor`): 32x32 images, not split,
    8-pixel patches shuffled 2x2 (`scale_factor`), so 4 image tokens between the global-image markers. Saved in
    parts (`_save_parts`); the processor itself also needs `num2words` to load."""
    import transformers as T

    tokenizer = special_tokenizer(["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                            "<global-img>"], bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                           pad_token="<|endoftext|>", image_token="<image>",
                           fake_image_token="<fake_token_around_image>", global_image_token="<global-img>",
                           end_of_utterance_token="<end_of_utterance>")
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                **token_ids(tokenizer, bos_token_id="<|im_start|>", eos_token_id="<end_of_utterance>",
                       pad_token_id="<|endoftext|>"))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = T.SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2,
                             **token_ids(tokenizer, image_token_id="<image>", pad_token_id="<|endoftext|>"))
    torch.manual_seed(SEED)
    model = T.SmolVLMForConditionalGeneration(config)
    images = T.SmolVLMImageProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 32},
                                     do_image_splitting=False)
    return _save_parts(folder, model, "SmolVLMProcessor", images, tokenizer, SMOLVLM_TEMPLATE, image_seq_len=4)


def write_paligemma(folder: Path) -> Path:
    """PaliGemma (`PaliGemmaForConditionalGeneration`: a SigLIP tower, a Gemma decoder; `PaliGemmaProcessor`):
    32x32 images in 8-pixel patches, 16 image tokens. The tokenizer holds `<image>` and the 1152 location and
    segmentation tokens the processor adds (as the published one does), and the model's vocabulary covers them."""
    import transformers as T
    from transformers.models.paligemma.processing_paligemma import EXTRA_TOKENS

    tokenizer = special_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "<image>"], bos_token="<bos>", eos_token="<eos>",
                           pad_token="<pad>", image_token="<image>")
    tokenizer.add_tokens(EXTRA_TOKENS)
    text = dict(model_type="gemma", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                max_position_embeddings=512,
                **token_ids(tokenizer, bos_token_id="<bos>", eos_token_id="<eos>", pad_token_id="<pad>"))
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8, vision_use_head=False)
    config = T.PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=64, hidden_size=64,
                               vocab_size=len(tokenizer), **token_ids(tokenizer, image_token_index="<image>"))
    torch.manual_seed(SEED)
    model = T.PaliGemmaForConditionalGeneration(config)
    spread_weights(model.model.language_model)
    images = T.SiglipImageProcessor(size={"height": 32, "width": 32}, image_seq_length=16)
    return save_with_processor(folder, model, T.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer))


def _save_parts(folder: Path, model, processor_class: str, images, tokenizer, chat_template: str,
                **processor_kwargs) -> Path:
    """A processor with a video slot (Qwen2-VL's, SmolVLM's) saved as its parts, the way the published checkpoints
    hold it: transformers 5 neither builds nor saves such a processor without a video processor, and every video
    processor needs torchvision, which the project does not install. The image processor goes to
    `preprocessor_config.json` (where `AutoVideoProcessor` also finds its settings, where torchvision is there), the
    tokenizer with the chat template to `tokenizer.json`/`tokenizer_config.json`/`chat_template.jinja`, and the
    processor's class and own arguments to `processor_config.json`."""
    import json

    folder = Path(folder)
    model.eval().save_pretrained(folder)
    tokenizer._set_processor_class(processor_class)  # as the processor's save_pretrained does
    tokenizer.chat_template = chat_template
    images.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = {**processor_kwargs, "processor_class": processor_class}
    (folder / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                                  encoding="utf-8")
    return folder


FAMILIES: dict[str, Callable[[Path], Path]] = {
    "qwen2_vl": write_qwen2_vl,
    "llava": write_llava,
    "smolvlm": write_smolvlm,
    "paligemma": write_paligemma,
    "florence2": tiny_florence2_folder,
}


#: What each family is asked: chat models "describe the image" in their template, PaliGemma a prefix, Florence-2 a task.
ASKED = {"qwen2_vl": "describe the image", "llava": "describe the image", "smolvlm": "describe the image",
         "paligemma": "caption en", "florence2": "<CAPTION>"}


def transformers_inputs(processor, image, text: str) -> dict:
    """What transformers' own processor makes of one image and `text`: its `apply_chat_template` with the image where
    it has a chat template (SmolVLM's needs a video processor, so its template is rendered by the tokenizer first, as
    its processor would), else the processor on the raw prompt (PaliGemma's prefix, Florence-2's task token)."""
    if getattr(processor, "chat_template", None) is None:
        return dict(processor(images=[image], text=[text], return_tensors="pt"))
    conversation = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
    try:
        return dict(processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="pt"))
    except AttributeError:  # SmolVLM's reads its video processor's frame count
        rendered = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            chat_template=processor.chat_template, add_generation_prompt=True, tokenize=False)
        return dict(processor(images=[image], text=[rendered], return_tensors="pt"))


def transformers_caption(folder: Path, image, text: str, tokens: int) -> str:
    """transformers' own text for one image: `from_pretrained`, the processor (`transformers_inputs`), greedy
    `generate`, decoded without special tokens."""
    import transformers

    from streamwise.runtime.generation import load_processor  # transformers' processor (without its video part)

    processor = load_processor(folder)
    inputs = transformers_inputs(processor, image, text)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    made = out[0] if model.config.is_encoder_decoder else out[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(made, skip_special_tokens=True)
