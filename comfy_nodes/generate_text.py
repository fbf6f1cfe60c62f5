"""Streamwise Generate Text: run a text model from the Streamwise loader, e.g. as a prompt enhancer."""

from __future__ import annotations

import torch
from comfy_api.latest import io, ui

from ..runtime.checkpoint import load_tokenizer
from ..runtime.generation import TokenSteps, fit_prompt, generation_config, interrupt_at_blocks, new_tokens
from .inputs import loaded_tree
from .schema import schema


class StreamwiseGenerateText(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            category="text", aliases=("llm", "text generation", "prompt", "gguf"),
            node_id="StreamwiseGenerateText",
            display_name="Streamwise Generate Text",
            description="Generate text with a model loaded by the Streamwise Model Loader (a causal LM, an "
                        "encoder-decoder such as T5, a vision-language model used for text; tokenizer: its folder), "
                        "e.g. as a prompt enhancer; the text shows on the node.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model",
                               tooltip="A text model from the Streamwise Model Loader (tokenizer: its folder)."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="The text to continue (an encoder-decoder's input); bounded by the "
                                        "model's context."),
                io.Int.Input("max_new_tokens", default=128, min=1, max=8192,
                             tooltip="The most tokens to generate; it stops earlier at end-of-text, and "
                                     "within the model's context (clipped, with a note on the node)."),
                io.Int.Input("seed", default=0, min=0, max=2**63 - 1, control_after_generate=True,
                             tooltip="Seeds sampling, so a run can be repeated; greedy ignores it."),
                io.Boolean.Input("do_sample", default=True,
                                 tooltip="Sample the next token; off picks the most likely one (greedy)."),
                io.Float.Input("temperature", default=0.7, min=0.01, max=5.0, step=0.01,
                               tooltip="Sampling only: lower is more predictable, higher more varied."),
                io.Float.Input("top_p", default=0.9, min=0.0, max=1.0, step=0.01,
                               tooltip="Sampling only: draw from the likeliest tokens that add up to this share."),
                io.Int.Input("top_k", default=50, min=0, max=1000,
                             tooltip="Sampling only: draw from this many likeliest tokens (0: no limit)."),
            ],
            outputs=[io.String.Output("text", display_name="text", tooltip="The generated text, without the prompt.")],
        )

    @classmethod
    def execute(cls, model, prompt: str, max_new_tokens: int, seed: int, do_sample: bool, temperature: float,
                top_p: float, top_k: int) -> io.NodeOutput:
        import comfy.model_management
        import comfy.utils
        import transformers

        tree, source = loaded_tree(model, "text")
        try:
            tokenizer = load_tokenizer(source)  # its folder's files, or the one a .gguf carries
        except (OSError, ValueError) as exc:
            raise ValueError(f"no tokenizer in {source}: {exc}") from None
        fit = fit_prompt(prompt, tokenizer, tree, max_new_tokens)
        comfy.model_management.load_models_gpu([model])
        ids = fit.ids.to(model.load_device)
        pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        config = generation_config(tree, fit.max_new_tokens, do_sample, pad, prompt_length=ids.shape[1],
                                   temperature=temperature, top_p=top_p, top_k=top_k)
        check_interrupt = getattr(comfy.model_management, "throw_exception_if_processing_interrupted", lambda: None)
        steps = TokenSteps(comfy.utils.ProgressBar(fit.max_new_tokens).update, check_interrupt)
        torch.manual_seed(seed)  # sampling draws from torch's global generator
        with torch.no_grad(), interrupt_at_blocks(tree, check_interrupt):
            tokens = tree.generate(
                ids, generation_config=config, stopping_criteria=transformers.StoppingCriteriaList([steps]),
            )
        text = tokenizer.decode(new_tokens(tree, ids, tokens), skip_special_tokens=True)
        shown = text if fit.note is None else f"{text}\n\n(note: {fit.note})"
        return io.NodeOutput(text, ui=ui.PreviewText(shown))
