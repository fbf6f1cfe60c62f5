"""Streamwise Model Loader: a checkpoint and a policy in, a MODEL that partial-loads correctly out."""

from __future__ import annotations

from pathlib import Path

import torch

from ..runtime.checkpoint import load_pretrained
from ..runtime.hosts.comfyui import model_patcher
from .folders import chosen_policy, comfy_policy_dirs, model_roots, policy_choices
from .model_files import list_models, resolve_model

DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class StreamwiseModelLoader:
    TITLE = "Streamwise Model Loader"
    CATEGORY = "streamwise"
    DESCRIPTION = (
        "Load a transformers-style model (an HF folder, or a .safetensors or .gguf file beside its config.json) from "
        "the model folders streamwise, text_encoders and LLM, and convert it with a Streamwise policy."
    )
    FUNCTION = "load"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": (
                list(list_models(model_roots())) or ["(no models found)"],
                {"tooltip": "From ComfyUI's model folders streamwise, text_encoders and LLM (models/streamwise, "
                            "models/text_encoders, models/clip, models/LLM and extra_model_paths.yaml): each folder "
                            "with a config.json, whole or as one of its .safetensors/.gguf files."},
            ),
            "policy": (policy_choices(auto=True), {"tooltip": "`auto` picks by the policies' [match] tables."}),
            "dtype": (list(DTYPES), {"default": "auto"}),
        }}

    def load(self, model, policy, dtype):
        import comfy.model_management
        import comfy.utils

        dirs = comfy_policy_dirs()
        policy = chosen_policy(policy, dirs, auto=True)
        path = resolve_model(model, model_roots())
        progress = comfy.utils.ProgressBar(100)
        tree, report, chosen = load_pretrained(
            path, policy, dtype=DTYPES[dtype], policy_dirs=dirs,
            progress=lambda done, total: progress.update_absolute(done * 100 // max(total, 1), 100),
        )
        patcher = model_patcher(tree, load_device=comfy.model_management.get_torch_device(),
                                offload_device=comfy.model_management.unet_offload_device())
        text = (f"{chosen}; {report.tensors} tensors from {Path(report.file).name}"
                + (f"; residents {report.residents}" if report.residents else ""))
        return (patcher, text)
