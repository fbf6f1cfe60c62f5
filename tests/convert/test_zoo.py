"""The transformers zoo: every model class that builds from its default config converts with no hand-written policy.

Every installed `*ForCausalLM` and `*ForConditionalGeneration` class, and the main encoder, audio and vision base
models, built on the `meta` device from its default config; the policy picked by `auto`, the plan resolved: no
plan error and no stranded byte, for each one, and the same policy and plan when `auto` matches the keys its saved
file would list (the checkpoint route) as when it reads the tree in memory. A class whose default config does not
build is not a Streamwise failure (docs/ list them with their reasons); the test asserts that nearly all
build, so it cannot pass vacuously. The builds run in a pool of worker processes, one per core (about 0.1 s per
model).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

transformers = pytest.importorskip("transformers")

BASE_MODELS = [
    "BertModel", "RobertaModel", "DebertaV2Model", "DistilBertModel", "AlbertModel", "ElectraModel",
    "XLMRobertaModel", "ModernBertModel", "T5EncoderModel", "CLIPTextModel", "ViTModel", "CLIPModel",
    "CLIPVisionModel", "SiglipModel", "SiglipVisionModel", "Dinov2Model", "ConvNextModel", "ConvNextV2Model",
    "SwinModel", "BeitModel", "ResNetModel", "SegformerModel", "MobileViTModel", "SamModel", "WhisperModel",
    "Wav2Vec2Model", "Wav2Vec2BertModel", "HubertModel", "WavLMModel", "EncodecModel", "MimiModel", "DacModel",
    "ASTModel", "SpeechT5Model", "ClapModel",
]


def zoo_names() -> list[str]:
    names = [name for name in dir(transformers) if name.endswith(("ForCausalLM", "ForConditionalGeneration"))
             and not name.startswith("Auto")]
    return sorted(names) + [name for name in BASE_MODELS if hasattr(transformers, name)]


def convert_on_meta(name: str) -> tuple[str, str, str]:
    """(name, outcome, detail): `built` with the policy `auto` picked and the problems found, or `no-build`."""
    import torch

    import streamwise
    from streamwise.runtime.plan.auto import select_policy

    cls = getattr(transformers, name)
    try:
        config = cls.config_class()
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:  # the library's default config does not build: not ours to judge
        return name, "no-build", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    model_type = getattr(config, "model_type", None)
    in_memory = select_policy(model, model_type=model_type)
    policy, plan = in_memory.policy, streamwise.resolve(in_memory.policy, model)
    problems = [f"{d.code}: {d.message[:200]}" for d in plan.diagnostics if d.is_error]
    from_file = select_policy(model, model_type=model_type, keys=file_keys(model))  # what a saved folder lists
    if (from_file.policy.name, from_file.resolved[0].modules) != (policy.name, plan.modules):
        problems.append(f"from its file's keys `auto` picks `{from_file.policy.name}`, in memory `{policy.name}`")
    if plan.coverage.bytes["stranded"]:
        problems.append(f"stranded {plan.coverage.bytes['stranded']} bytes: {plan.coverage.stranded[0].name}")
    return name, "built", f"{policy.name}|" + "; ".join(problems)


def file_keys(model) -> list[str]:
    """The keys `save_pretrained` writes: the state dict with each tied tensor once (the first name it has)."""
    seen, keys = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            keys.append(name)
    return keys


@pytest.fixture(scope="module")
def zoo() -> list[tuple[str, str, str]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), mp_context=context) as pool:
        return list(pool.map(convert_on_meta, zoo_names(), chunksize=4))


def test_every_model_that_builds_converts_by_auto_with_nothing_stranded(zoo):
    built = [(name, detail) for name, outcome, detail in zoo if outcome == "built"]
    failed = [(name, detail) for name, detail in built if detail.split("|", 1)[1]]
    assert failed == []
    assert len(built) >= 0.9 * len(zoo) and len(built) >= 300, f"only {len(built)} of {len(zoo)} built"


def test_auto_picks_a_family_policy_where_there_is_one_and_never_refuses(zoo):
    policies = {name: detail.split("|", 1)[0] for name, outcome, detail in zoo if outcome == "built"}
    assert policies["Qwen2ForCausalLM"] == "decoder-llm" and policies["LlamaForCausalLM"] == "decoder-llm"
    assert policies["VibeVoiceForConditionalGeneration"] == "vibevoice"
    assert policies["Qwen3ForCausalLM"] == "transformers" and policies["GemmaForCausalLM"] == "transformers"
    assert set(policies.values()) <= {"decoder-llm", "vibevoice", "transformers"}
