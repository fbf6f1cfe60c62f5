"""Streamwise Generate Text: run a causal LM from the Streamwise loader, e.g. as a prompt enhancer."""

from __future__ import annotations

import torch

from ..runtime.engine import applied_state


class StreamwiseGenerateText:
    TITLE = "Streamwise Generate Text"
    CATEGORY = "streamwise"
    DESCRIPTION = "Generate text with a causal LM loaded by the Streamwise Model Loader (tokenizer from its folder)."
    FUNCTION = "generate"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("text",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "prompt": ("STRING", {"multiline": True, "default": ""}),
            "max_new_tokens": ("INT", {"default": 128, "min": 1, "max": 8192}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**63 - 1}),
            "do_sample": ("BOOLEAN", {"default": True}),
            "temperature": ("FLOAT", {"default": 0.7, "min": 0.01, "max": 5.0, "step": 0.01}),
            "top_p": ("FLOAT", {"default": 0.9, "min": 0.0, "max": 1.0, "step": 0.01}),
            "top_k": ("INT", {"default": 50, "min": 0, "max": 1000}),
        }}

    def generate(self, model, prompt, max_new_tokens, seed, do_sample, temperature, top_p, top_k):
        import comfy.model_management
        import transformers

        state = applied_state(model.model)
        source = state.source if state is not None else None
        if source is None:
            raise ValueError("this MODEL has no tokenizer folder: load it with the Streamwise Model Loader")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"no tokenizer in {source}: {exc}") from None
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise ValueError("the prompt tokenizes to no tokens: write a prompt to continue")
        comfy.model_management.load_models_gpu([model])
        ids = ids.to(model.load_device)
        torch.manual_seed(seed)  # sampling draws from torch's global generator
        with torch.no_grad():
            tokens = model.model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_p=top_p,
                top_k=top_k,
                pad_token_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
            )
        return (tokenizer.decode(tokens[0, ids.shape[1]:], skip_special_tokens=True),)
