"""A ComfyUI node running transformers' own `from_pretrained` + `generate` on a model folder: the peer in
bench_headroom.py's server trials, linked into that bench's server's custom_nodes (never shipped).

It imports, as the server starts, what either loader imports only when it runs (transformers with Qwen2's modeling
code, and Streamwise), so the idle server holds both and a trial's headroom is its load's and generation's alone."""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import Qwen2ForCausalLM  # noqa: F401  (the modeling code, imported at the start)

import streamwise  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import reference_text  # the tests' transformers text: one home


class TransformersGenerateText:
    """transformers' text for a prompt, framed by the tokenizer's chat template, greedy."""

    CATEGORY = "streamwise/bench"
    FUNCTION = "generate"
    RETURN_TYPES = ()
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"folder": ("STRING", {"default": ""}), "prompt": ("STRING", {"default": ""}),
                             "system": ("STRING", {"default": ""}), "chat": ("BOOLEAN", {"default": True}),
                             "max_new_tokens": ("INT", {"default": 8, "min": 1, "max": 4096})}}

    def generate(self, folder: str, prompt: str, system: str, chat: bool, max_new_tokens: int) -> dict:
        return {"ui": {"text": [reference_text(Path(folder), prompt, max_new_tokens, system, chat)]}}


NODE_CLASS_MAPPINGS = {"TransformersGenerateText": TransformersGenerateText}
