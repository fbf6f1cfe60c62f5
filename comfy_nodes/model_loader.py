"""Streamwise Model Loader: a checkpoint and a policy in, a MODEL that partial-loads correctly out."""

from __future__ import annotations

import contextlib
import json

import torch
from comfy_api.latest import io, ui

from ..runtime.checkpoint import load_pretrained, load_tokenizer
from ..runtime.checkpoint.discover import list_models, model_identity, resolve_model
from ..runtime.hosts.comfyui import load_again, model_patcher
from .errors import NodeInputError
from .folders import (
    allow_stranded_input,
    chosen_policy,
    comfy_policy_dirs,
    model_roots,
    policy_fingerprint,
    policy_input,
    skip_unreadable_input,
)
from .schema import schema

DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class StreamwiseModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            category="loaders", reports=True,
            aliases=("gguf", "llm", "safetensors", "diffusers", "vibevoice", "tts", "offload", "lowvram", "load model"),
            node_id="StreamwiseModelLoader",
            display_name="Streamwise Model Loader",
            description="Load a transformers-style model (an HF folder, a .safetensors or .gguf file beside its "
                        "config.json, or a .gguf from llama.cpp's converter alone) from the model folders "
                        "streamwise, text_encoders and LLM, and convert it with a Streamwise policy.",
            inputs=[
                io.Combo.Input(
                    "model", options=list(list_models(model_roots())) or ["(no models found)"],
                    tooltip="From ComfyUI's model folders streamwise, text_encoders and LLM (models/streamwise, "
                            "models/text_encoders, models/clip, models/LLM and extra_model_paths.yaml): each folder "
                            "with a config.json, whole or as one of its .safetensors/.gguf files, and each .gguf that "
                            "describes its model in its metadata (llama.cpp's layout, or `streamwise quantize`'s "
                            "carrying config.json).",
                ),
                policy_input("The policy to convert by; `auto` picks by the policies' [match] tables.", auto=True),
                io.Combo.Input("dtype", options=list(DTYPES), default="auto",
                               tooltip="The dtype of the floating-point weights; `auto` takes the one most of the "
                                       "checkpoint's values are stored in."),
                allow_stranded_input(),
                io.String.Input(
                    "host_budget", default="auto", optional=True,
                    tooltip="Host memory the weights may take: `auto` (what this process can still allocate, "
                            "counting a container's memory limit, which ComfyUI's own free-RAM figure does not, less "
                            "10% of the limit) or a size such as `12GiB`. Streamed blocks past it stay in their "
                            "file and are read at each step; a model whose fixed part does not fit is refused "
                            "before anything is read, with both figures, instead of ending in the OOM killer."),
                skip_unreadable_input(),
            ],
            hidden=[io.Hidden.unique_id],
            outputs=[
                io.Model.Output("model_out", display_name="model",
                                tooltip="The converted model, ready to partial-load."),
                io.String.Output("report", display_name="report",
                                 tooltip="The policy chosen and what was loaded from which file."),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, model: str, policy: str, dtype: str, allow_stranded: bool = False,
                           host_budget: str = "auto", skip_unreadable_policies: bool = False) -> str:
        """The model's files (path, size, mtime) and the policy's content: a replaced model or an edited policy
        (or any file it extends) loads again; an unchanged one stays cached."""
        try:
            files = model_identity(resolve_model(model, model_roots()))
        except (FileNotFoundError, OSError):
            files = ()  # execute says what is wrong
        return json.dumps([files, policy_fingerprint(policy, comfy_policy_dirs()), dtype, allow_stranded, host_budget,
                           skip_unreadable_policies])

    @classmethod
    def execute(cls, model: str, policy: str, dtype: str, allow_stranded: bool = False,
                host_budget: str = "auto", skip_unreadable_policies: bool = False) -> io.NodeOutput:
        import comfy.model_management
        import comfy.utils

        if dtype not in DTYPES:  # an API prompt may send anything (the older core does not check V3 choices)
            raise NodeInputError(f"dtype `{dtype}` is not one of {', '.join(DTYPES)}")
        dirs = comfy_policy_dirs()
        policy = chosen_policy(policy, dirs, auto=True)
        path = resolve_model(model, model_roots())
        progress = comfy.utils.ProgressBar(100)

        def load():
            # The generate nodes read the model's tokenizer next (cached): read first, the host budget counts it (a
            # 32,000-word one holds 8 MiB). A failure here is said where the tokenizer is used, if it is.
            with contextlib.suppress(Exception):
                load_tokenizer(path)
            tree, report, chosen = load_pretrained(
                path, policy, dtype=DTYPES[dtype], policy_dirs=dirs, allow_stranded=allow_stranded,
                progress=lambda done, total: progress.update_absolute(done * 100 // max(total, 1), 100),
                max_memory={"cpu": host_budget}, skip_unreadable=skip_unreadable_policies,
            )
            patcher = model_patcher(tree, load_device=comfy.model_management.get_torch_device(),
                                    offload_device=comfy.model_management.unet_offload_device(),
                                    allow_stranded=allow_stranded)
            return patcher, f"{chosen}; {report}"

        node = getattr(cls.hidden, "unique_id", None)  # None: called outside a prompt (a test, another node)
        patcher, text = load_again(node, load)  # this node's previous model makes room if need be
        return io.NodeOutput(patcher, text, ui=ui.PreviewText(text))
