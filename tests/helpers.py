"""Shared test helpers (tests/ is on sys.path through pytest's `pythonpath`)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
INVALID = TESTS / "fixtures" / "invalid"
REPO = TESTS.parent


def write_policy(folder: Path, name: str, body: str = "", *, version: int = 1) -> Path:
    """A policy file `name.toml` in `folder` with the required header and `body` after it."""
    path = folder / f"{name}.toml"
    path.write_text(f'schema_version = {version}\n\n[policy]\nname = "{name}"\n{body}', encoding="utf-8")
    return path


def gguf_policy(folder: Path, gguf_type: str) -> Path:
    """A policy extending decoder-llm whose Linear layers are GGUF residents written as `gguf_type`."""
    return write_policy(folder, gguf_type.lower(), 'extends = "decoder-llm"\n\n[[quant.rule]]\nid = "linears"\n'
                        f'select = {{ class = "Linear" }}\nformat = "gguf"\ngguf_type = "{gguf_type}"\n')


def make_policy(**sections):
    """A Policy from plain data, e.g. make_policy(stream={"rule": [...]})."""
    from streamwise.schemas import Policy

    return Policy.model_validate({"schema_version": 1, "policy": {"name": "test"}, **sections})


def stream_rule(rule_id: str, kind: str, **select) -> dict:
    return {"id": rule_id, "kind": kind, "select": select}


def force_streaming(model, on: bool = True) -> None:
    """Make every streamed leaf take the fetching path, as a host does for offloaded leaves."""
    from streamwise.runtime.engine import protocol

    for module in model.modules():
        if protocol.kind_of(module) is not None:
            protocol.set_fetching(module, on)


def tiny_qwen2(**overrides):
    import transformers

    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    config.update(overrides)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)).eval()


def tiny_acoustic_tokenizer():
    import transformers

    config = transformers.VibeVoiceAcousticTokenizerConfig(
        hidden_size=16, num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1], kernel_size=3,
        layer_scale_init_value=0.5,  # large enough that a dropped gamma would show in the output
    )
    return transformers.VibeVoiceAcousticTokenizerModel(config).eval()


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


def vibevoice_inputs():
    """Token ids with 8 audio placeholders, and 32 samples of audio that encode to 8 latents."""
    import torch

    generator = torch.Generator().manual_seed(0)
    audio = torch.randn(1, 1, 32, generator=generator)
    ids = torch.tensor([[5, 2] + [4] * 8 + [3, 6, 7]])
    return dict(input_ids=ids, input_values=audio, padding_mask=torch.ones(1, 32, dtype=torch.bool), sample=False)
