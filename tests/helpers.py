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


def make_policy(**sections):
    """A Policy from plain data, e.g. make_policy(stream={"rule": [...]})."""
    from streamwise.schemas import Policy

    return Policy.model_validate({"schema_version": 1, "policy": {"name": "test"}, **sections})


def stream_rule(rule_id: str, kind: str, **select) -> dict:
    return {"id": rule_id, "kind": kind, "select": select}


def force_streaming(model, on: bool = True) -> None:
    """Make every streamed leaf take the fetching path, as a host does for offloaded leaves."""
    for module in model.modules():
        if hasattr(type(module), "_sw_kind"):
            module.comfy_cast_weights = on


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
