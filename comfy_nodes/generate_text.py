"""Streamwise Generate Text: run a text or vision-language model from the Streamwise loader: a prompt enhancer, a
chat model, an image captioner."""

from __future__ import annotations

from comfy_api.latest import io

from ..runtime.checkpoint import load_tokenizer
from ..runtime.generation import (
    SAMPLING_MODES,
    Sampling,
    TokenSteps,
    generate_text,
    interrupt_at_blocks,
    load_processor,
    prompts,
    takes_images,
)
from .errors import NodeInputError
from .inputs import loaded_tree, pil_images
from .schema import schema


class StreamwiseGenerateText(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            category="text",
            aliases=("llm", "text generation", "prompt", "gguf", "chat", "prompt enhancer", "caption", "describe",
                     "vision", "vlm", "image to text"),
            node_id="StreamwiseGenerateText",
            display_name="Streamwise Generate Text",
            description="Generate text with a model loaded by the Streamwise Model Loader (a causal LM, an "
                        "encoder-decoder such as T5, a vision-language model; tokenizer and processor: its folder): "
                        "a prompt enhancer, a chat model in its own chat template, or a captioner given an image "
                        "(one text per image of a batch). The text shows on the node.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model",
                               tooltip="A text model from the Streamwise Model Loader (tokenizer: its folder)."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="The user's turn of a chat model (with chat on), else the text to continue; "
                                        "for a captioner the instruction or task (Florence-2: <CAPTION>); bounded by "
                                        "the model's context."),
                io.String.Input("system", multiline=True, default="",
                                tooltip="A system turn before the prompt (chat models with chat on); empty: none, "
                                        "the chat template's own default where it has one."),
                io.Boolean.Input("chat", default=True,
                                 tooltip="Frame the prompt in the model's chat template (the user's turn, then the "
                                         "start of the model's reply) where its tokenizer or processor has one; off, "
                                         "or a model without one: the prompt is continued as it is."),
                io.Int.Input("max_new_tokens", default=128, min=1, max=8192,
                             tooltip="The most tokens to generate; it stops earlier at the model's end tokens, and "
                                     "within the model's context (clipped, with a note on the node)."),
                io.Int.Input("seed", default=0, min=0, max=2**63 - 1, control_after_generate=True,
                             tooltip="Seeds sampling, so a run can be repeated; greedy ignores it."),
                io.Combo.Input("sampling", options=list(SAMPLING_MODES), default=SAMPLING_MODES[0],
                               tooltip="How each token is picked: as the model's generation_config.json says (model "
                                       "default), the likeliest (greedy), or sampled with the three values below "
                                       "(custom)."),
                io.Float.Input("temperature", default=0.7, min=0.01, max=5.0, step=0.01,
                               tooltip="Custom sampling only: lower is more predictable, higher more varied."),
                io.Float.Input("top_p", default=0.9, min=0.0, max=1.0, step=0.01,
                               tooltip="Custom sampling only: draw from the likeliest tokens that add up to this "
                                       "share."),
                io.Int.Input("top_k", default=50, min=0, max=1000,
                             tooltip="Custom sampling only: draw from this many likeliest tokens (0: no limit)."),
                io.Image.Input("image", optional=True,
                               tooltip="Images for a vision-language model (Qwen2-VL, LLaVA, SmolVLM, PaliGemma, "
                                       "Florence-2...), through its own processor: one text per image of a batch."),
            ],
            outputs=[io.String.Output("text", display_name="text", is_output_list=True,
                                      tooltip="The generated text, without the prompt: one per image (one without an "
                                              "image), so a node after it runs once per text.")],
        )

    @classmethod
    def execute(cls, model, prompt: str, system: str, chat: bool, max_new_tokens: int, seed: int, sampling: str,
                temperature: float, top_p: float, top_k: int, image=None) -> io.NodeOutput:
        import comfy.model_management
        import comfy.utils

        tree, source = loaded_tree(model, "text")
        chosen = Sampling(sampling, temperature, top_p, top_k)  # an API prompt may send any string: checked here
        try:
            tokenizer = load_tokenizer(source)  # its folder's files, or the one a .gguf carries
        except (OSError, ValueError) as exc:
            raise NodeInputError(f"no tokenizer in {source}: {exc}") from None
        images = pil_images(image)
        processor = load_processor(source) if images and takes_images(tree) else None
        given = prompts(tree, tokenizer, prompt, max_new_tokens, system=system, chat=chat, images=images,
                        processor=processor)
        comfy.model_management.load_models_gpu([model])
        check_interrupt = getattr(comfy.model_management, "throw_exception_if_processing_interrupted", lambda: None)
        steps = TokenSteps(comfy.utils.ProgressBar(sum(each.max_new_tokens for each in given)).update, check_interrupt)
        with interrupt_at_blocks(tree, check_interrupt):
            texts = [generate_text(tree, each, tokenizer, sampling=chosen, seed=seed, device=model.load_device,
                                   stopping_criteria=[steps]) for each in given]
        shown = [text if each.note is None else f"{text}\n\n(note: {each.note})"
                 for text, each in zip(texts, given, strict=True)]
        return io.NodeOutput(texts, ui={"text": shown})  # one text box entry per text, as the output has them
