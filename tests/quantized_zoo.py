"""The quantized zoo's cases: a real model class at a small size whose Linear widths are multiples of 256 (so every
format's blocks fit and layers really are quantized), quantized by one format the way users do it, compared with
the float model.

Routes: `int8`, `convrot_int8`, `convrot_int4` by a policy's quant rule in memory; GGUF types through the file
(`save_pretrained` -> `streamwise quantize` -> `load_pretrained`). A case passes when the output is within the
format's envelope of the float model (cosine similarity, `ENVELOPE`) and budget 0 computes exactly what the
resident model computes. `tests/quant/test_quantized_zoo.py` runs a sample; `benchmarks/quantized_zoo.py` every class.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FORMATS = ("int8", "convrot_int8", "convrot_int4", "Q8_0", "Q4_0")
ENVELOPE = {"int8": 0.999, "convrot_int8": 0.999, "Q8_0": 0.999, "convrot_int4": 0.95, "Q4_0": 0.95}
"""Cosine similarity of the output with the float model's, per format: 8-bit 0.999; 4-bit 0.95, because randomly
initialized weights (no structure, no outliers) carry 4-bit noise of ~8% per layer that compounds through the stack
(measured 0.971-0.9998 over the sample). A silent wrong number, such as GGUF T5's activations cast to the blocks'
uint8, is far outside either."""


def _transformers(class_name: str, config: dict, inputs: Callable[[], dict]):
    def build():
        import transformers

        cls = getattr(transformers, class_name)
        torch.manual_seed(0)
        return cls(cls.config_class(**config)).eval(), inputs()

    return build


_TEXT = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)


def _IDS() -> dict:
    return dict(input_ids=torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))


CASES: dict[str, Callable[[], tuple[nn.Module, dict]]] = {
    "Qwen2ForCausalLM": _transformers("Qwen2ForCausalLM", {**_TEXT, "num_key_value_heads": 2}, _IDS),
    "LlamaForCausalLM": _transformers("LlamaForCausalLM", {**_TEXT, "num_key_value_heads": 2}, _IDS),
    "T5ForConditionalGeneration": _transformers(
        "T5ForConditionalGeneration",
        dict(vocab_size=512, d_model=256, d_kv=64, d_ff=512, num_layers=2, num_heads=4, decoder_start_token_id=0),
        lambda: dict(input_ids=torch.tensor([[3, 1, 4, 1, 5, 9]]), decoder_input_ids=torch.tensor([[0, 7, 3]]))),
    "BertModel": _transformers("BertModel", _TEXT, _IDS),
    "ViTModel": _transformers(
        "ViTModel", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         image_size=32, patch_size=8),
        lambda: dict(pixel_values=torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)))),
    "WhisperForConditionalGeneration": _transformers(
        "WhisperForConditionalGeneration",
        dict(vocab_size=512, d_model=256, encoder_ffn_dim=512, decoder_ffn_dim=512, encoder_layers=2,
             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, num_mel_bins=16,
             max_source_positions=16, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
             bos_token_id=1, eos_token_id=2),
        lambda: dict(input_features=torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1)),
                     decoder_input_ids=torch.tensor([[1, 5, 7]]))),
}


def _flux():
    import diffusers

    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=4,
        joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=(16, 24, 24))
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 64, generator=generator),
                  encoder_hidden_states=torch.randn(1, 8, 256, generator=generator),
                  pooled_projections=torch.randn(1, 256, generator=generator), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3))
    return model.eval(), inputs


def _diffusers(class_name: str, config: dict, inputs: Callable[[torch.Generator], dict]):
    """A diffusers model class at a small size, with inputs drawn from a fixed generator."""

    def build():
        import diffusers

        torch.manual_seed(0)
        return getattr(diffusers, class_name)(**config).eval(), inputs(torch.Generator().manual_seed(1))

    return build


CASES["FluxTransformer2DModel"] = _flux
CASES["UNet2DConditionModel"] = _diffusers(  # Stable Diffusion's UNet: convolutions stay float, attention quantizes
    "UNet2DConditionModel",
    dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(256, 256),
         down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
         cross_attention_dim=256, attention_head_dim=4, norm_num_groups=32),
    lambda g: dict(sample=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g)))
CASES["SD3Transformer2DModel"] = _diffusers(
    "SD3Transformer2DModel",
    dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=64,
         num_attention_heads=4, joint_attention_dim=256, caption_projection_dim=256, pooled_projection_dim=256,
         pos_embed_max_size=16),
    lambda g: dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g),
                   pooled_projections=torch.randn(1, 256, generator=g)))
CASES["WanTransformer3DModel"] = _diffusers(
    "WanTransformer3DModel",
    dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=4, out_channels=4,
         text_dim=256, freq_dim=256, ffn_dim=512, num_layers=2, rope_max_seq_len=32),
    lambda g: dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g)))

CASES["LTXVideoTransformer3DModel"] = _diffusers(  # declares `_repeated_blocks` only
    "LTXVideoTransformer3DModel",
    dict(in_channels=64, out_channels=64, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=64,
         cross_attention_dim=256, num_layers=2, caption_channels=256),
    lambda g: dict(hidden_states=torch.randn(1, 32, 64, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g), encoder_attention_mask=torch.ones(1, 8),
                   num_frames=2, height=4, width=4))
CASES["QwenImageTransformer2DModel"] = _diffusers(
    "QwenImageTransformer2DModel",
    dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=64, num_attention_heads=4,
         joint_attention_dim=256, axes_dims_rope=(16, 24, 24)),
    lambda g: dict(hidden_states=torch.randn(1, 16, 64, generator=g), timestep=torch.tensor([0.5]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g),
                   encoder_hidden_states_mask=torch.ones(1, 8), img_shapes=[(1, 4, 4)]))
CASES["HunyuanVideoTransformer3DModel"] = _diffusers(
    "HunyuanVideoTransformer3DModel",
    dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=64, num_layers=1,
         num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=256,
         pooled_projection_dim=256, rope_axes_dim=(16, 24, 24)),
    lambda g: dict(hidden_states=torch.randn(1, 4, 1, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g), encoder_attention_mask=torch.ones(1, 8),
                   pooled_projections=torch.randn(1, 256, generator=g), guidance=torch.tensor([3500.0])))
CASES["PixArtTransformer2DModel"] = _diffusers(
    "PixArtTransformer2DModel",
    dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=64, num_attention_heads=4, in_channels=4,
         out_channels=8, cross_attention_dim=256, caption_channels=256, norm_num_groups=32),
    lambda g: dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g),
                   added_cond_kwargs={"resolution": None, "aspect_ratio": None}))
CASES["SanaTransformer2DModel"] = _diffusers(
    "SanaTransformer2DModel",
    dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=64, num_layers=2,
         num_cross_attention_heads=4, cross_attention_head_dim=64, cross_attention_dim=256, caption_channels=256,
         sample_size=8, patch_size=1),
    lambda g: dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g)))
CASES["CogVideoXTransformer3DModel"] = _diffusers(
    "CogVideoXTransformer3DModel",
    dict(num_attention_heads=4, attention_head_dim=64, in_channels=4, out_channels=4, text_embed_dim=256,
         time_embed_dim=256, num_layers=2, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
         temporal_compression_ratio=4, max_text_seq_length=8),
    lambda g: dict(hidden_states=torch.randn(1, 2, 4, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g)))
CASES["AuraFlowTransformer2DModel"] = _diffusers(
    "AuraFlowTransformer2DModel",
    dict(sample_size=8, patch_size=2, in_channels=16, num_mmdit_layers=1, num_single_dit_layers=1,
         attention_head_dim=64, num_attention_heads=4, joint_attention_dim=256, caption_projection_dim=256,
         out_channels=16, pos_embed_max_size=16),
    lambda g: dict(hidden_states=torch.randn(1, 16, 8, 8, generator=g), timestep=torch.tensor([10]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g)))
CASES["Lumina2Transformer2DModel"] = _diffusers(
    "Lumina2Transformer2DModel",
    dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, hidden_size=256, num_layers=2,
         num_refiner_layers=1, num_attention_heads=4, num_kv_heads=4, multiple_of=256, cap_feat_dim=256,
         axes_dim_rope=(16, 24, 24), axes_lens=(64, 64, 64)),
    lambda g: dict(hidden_states=torch.randn(1, 16, 8, 8, generator=g), timestep=torch.tensor([0.5]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g),
                   encoder_attention_mask=torch.ones(1, 8, dtype=torch.bool)))
CASES["ChromaTransformer2DModel"] = _diffusers(
    "ChromaTransformer2DModel",
    dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=64,
         num_attention_heads=4, joint_attention_dim=256, axes_dims_rope=(16, 24, 24), approximator_num_channels=64,
         approximator_hidden_dim=256, approximator_layers=1),
    lambda g: dict(hidden_states=torch.randn(1, 16, 64, generator=g), timestep=torch.tensor([0.5]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g), img_ids=torch.zeros(16, 3),
                   txt_ids=torch.zeros(8, 3)))
CASES["Flux2Transformer2DModel"] = _diffusers(
    "Flux2Transformer2DModel",
    dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=64,
         num_attention_heads=4, joint_attention_dim=256, axes_dims_rope=(16, 16, 16, 16),
         timestep_guidance_channels=256),
    lambda g: dict(hidden_states=torch.randn(1, 16, 64, generator=g), timestep=torch.tensor([0.5]),
                   encoder_hidden_states=torch.randn(1, 8, 256, generator=g), img_ids=torch.zeros(16, 4),
                   txt_ids=torch.zeros(8, 4), guidance=torch.tensor([3.5])))


def output(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    for name in ("logits", "last_hidden_state", "sample"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def run_case(name: str, fmt: str, workdir: Path) -> dict:
    """One class under one format: its figures, and `within` (envelope and budget 0 both hold)."""
    import streamwise
    from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
    from streamwise.runtime.engine import protocol
    from streamwise.runtime.plan.auto import select_policy

    from helpers import gguf_policy, make_policy

    float_model, inputs = CASES[name]()
    expected = output(float_model, inputs)
    config = getattr(float_model, "config", None)
    base = select_policy(float_model, model_type=getattr(config, "model_type", None)).policy
    if fmt in ENVELOPE and fmt.startswith(("int8", "convrot")):
        rule = {"id": "zoo", "select": {"class": "Linear"}, "format": fmt,
                **({"group_size": 64} if fmt.startswith("convrot") else {})}
        policy = base.model_copy(update={"quant": make_policy(quant={"rule": [rule]}).quant})
        model = copy.deepcopy(float_model)
        streamwise.apply(streamwise.resolve(policy, model), model)
    else:
        folder = workdir / name
        float_model.save_pretrained(folder)
        policy = gguf_policy(workdir, fmt, base.name)
        quantize_to_gguf(next(folder.glob("*.safetensors")), folder / f"model.{fmt}.gguf", policy, float_model)
        model = streamwise.load_pretrained(folder / f"model.{fmt}.gguf", policy, progress=False).model
    residents = [m for m in model.modules() if protocol.is_resident(m)]
    float_bytes = sum(t.nbytes for t in float_model.state_dict().values())
    quantized = sum(int(m.in_features) * int(m.out_features) * 4 for m in residents)  # their float32 weights' bytes
    got = output(model, inputs)
    similarity = cosine(got, expected)
    streamwise.offload(model, policy, device="cpu", budget=0)
    identical = bool(torch.equal(output(model, inputs), got))
    return dict(case=name, format=fmt, residents=len(residents), quantized_share=quantized / float_bytes,
                cosine=similarity, budget0_identical=identical,
                within=bool(residents) and similarity >= ENVELOPE[fmt] and identical)
