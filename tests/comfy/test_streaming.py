"""Real ComfyUI core drives converted trees: placement (meta), LoRA numerics (CPU), load cycles.

Run against an older core (no `offloadable`) and a newer one; see CONTRIBUTING.md "Testing against ComfyUI".
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import streamwise
from streamwise.runtime.convert import applied_state

from helpers import SAMPLE, tiny_qwen2, tiny_sample, tiny_vibevoice, vibevoice_inputs

CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.fixture
def core(comfy_nodes):
    import comfy.model_patcher
    import comfy.ops

    return comfy


def plain_patcher(core, model, load_device):
    """The unconverted tree in a ModelPatcher (only `device` made assignable, nothing else)."""
    cls = type(model)
    device = property(lambda self: self.__dict__.get("_d"), lambda self, v: self.__dict__.__setitem__("_d", v))
    model.__class__ = type(cls.__name__, (cls,), {"device": device})
    return core.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=CPU)


def stranded(model) -> list[str]:
    """CPU tensors that no streaming path will bring to the compute device when they are used."""
    found = []
    for path, module in model.named_modules():
        streams = getattr(module, "comfy_cast_weights", False) or getattr(module, "weight_function", None)
        relocated = module.__dict__.get("_sw_relocated", ())
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if name in relocated:
                tensor = getattr(module, name)  # a read is a use: relocated tensors follow then
            if tensor.device.type == "cpu" and not streams:
                found.append(f"{path}.{name}")
    return found


def test_the_fetcher_matches_the_cores_cast_api(core):
    from streamwise.runtime.hosts.comfyui.patcher import ComfyFetcher

    offloadable = "offloadable" in inspect.signature(core.ops.cast_bias_weight).parameters
    assert ComfyFetcher({})._offloadable is offloadable
    assert hasattr(core.ops, "uncast_bias_weight") is offloadable


def test_partial_load_on_meta_strands_nothing_once_converted(core):
    ids = torch.randint(0, 128, (1, 6))
    budget = 60_000

    plain = tiny_qwen2()
    patcher = plain_patcher(core, plain, META)
    patcher.load(META, lowvram_model_memory=budget)
    assert stranded(plain)  # the problem: foreign leaves and buffers left behind on the CPU
    with pytest.raises(RuntimeError, match="expected device"):
        plain(ids.to(META))

    model = tiny_qwen2()
    patcher = streamwise.model_patcher(model, load_device=META, offload_device=CPU, policy="decoder-llm")
    patcher.load(META, lowvram_model_memory=budget)
    assert model.model_lowvram
    assert model(ids.to(META)).logits.is_meta  # relocated tensors followed; streamed leaves fetched
    assert stranded(model) == []
    assert model.model.rotary_emb.inv_freq.is_meta

    patcher.partially_load(META, 10**9)  # room for everything now: a full load
    assert all(p.is_meta for p in model.parameters())
    assert model(ids.to(META)).logits.is_meta


def lora_reference(model, key, diff):
    merged = copy.deepcopy(model)
    with torch.no_grad():
        merged.get_parameter(key).add_(diff)
    return merged


def test_lora_patches_apply_to_streamed_leaves(core):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 6))
    key, diff = "model.layers.1.mlp.down_proj.weight", torch.randn(64, 128) * 0.05
    original = tiny_qwen2()
    with torch.no_grad():
        expected = lora_reference(original, key, diff)(ids).logits
        unpatched = original(ids).logits

    model = copy.deepcopy(original)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="decoder-llm")
    assert patcher.add_patches({key: ("diff", (diff,))}, 1.0) == [key]  # the model's own state-dict keys
    patcher.load(CPU, lowvram_model_memory=20_000)
    leaf = model.get_submodule(key.rsplit(".", 1)[0])
    assert leaf.comfy_cast_weights and type(leaf.weight_function[0]).__name__ == "LowVramPatch"
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-6)
    assert torch.equal(leaf.weight, original.get_parameter(key))  # never patched in place

    plain = copy.deepcopy(original)
    patcher = plain_patcher(core, plain, CPU)
    patcher.add_patches({key: ("diff", (diff,))}, 1.0)
    patcher.load(CPU, lowvram_model_memory=20_000)
    with torch.no_grad():
        result = plain(ids).logits
    assert torch.equal(result, unpatched) and not torch.allclose(result, expected, atol=1e-6)


def cycle(patcher, run, expected):
    patcher.load(CPU, full_load=True)
    assert torch.equal(run(), expected)
    assert patcher.partially_unload(CPU, 10**9) >= 0
    assert torch.equal(run(), expected)
    patcher.partially_load(CPU, 30_000)
    assert torch.equal(run(), expected)
    patcher.detach()
    assert torch.equal(run(), expected)


def test_qwen2_generate_survives_load_unload_cycles(comfy_nodes):
    torch.manual_seed(0)
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (1, 5))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="decoder-llm")
    cycle(patcher, lambda: model.generate(ids, max_new_tokens=6, do_sample=False), expected)
    assert applied_state(model).tree.compute_device == CPU


def test_vibevoice_survives_load_unload_cycles(comfy_nodes):
    torch.manual_seed(0)
    model, inputs = tiny_vibevoice(), vibevoice_inputs()
    with torch.no_grad():
        expected = model(**inputs).logits
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="vibevoice")

    def run():
        with torch.no_grad():
            return model(**inputs).logits

    cycle(patcher, run, expected)


def test_storage_dtypes_are_archived_where_the_core_reads_them(core):
    model = tiny_qwen2().to(torch.bfloat16)
    streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="decoder-llm")
    q = model.model.layers[0].self_attn.q_proj
    if hasattr(core.model_management, "archive_model_dtypes"):
        assert q.weight_comfy_model_dtype == torch.bfloat16
    else:
        assert not hasattr(q, "weight_comfy_model_dtype")


def test_unloads_send_relocated_tensors_back(core, monkeypatch):
    sent = []
    monkeypatch.setattr("streamwise.runtime.hosts.comfyui.patcher.offload_relocated",
                        lambda model, device: sent.append(device))
    model = tiny_qwen2()
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="decoder-llm")
    patcher.load(CPU, full_load=True)
    patcher.partially_unload(CPU, 10**9)
    patcher.detach()
    assert sent and all(device == CPU for device in sent)
    assert applied_state(model).tree.compute_device == CPU


# Models nobody wrote a policy for, converted by `auto` (tests/helpers.py: the sample of tests/engine/test_generic.py).
ON_META = ["dense", "gemma", "gpt2", "encoder-decoder", "vision", "custom"]  # their forwards run on `meta`


def claimed_by_containers(model) -> set[int]:
    from streamwise.runtime.engine import protocol

    return {id(owner) for module in model.modules() for owner in protocol.claimed(module)}


@pytest.mark.parametrize("name", SAMPLE)
def test_any_model_by_auto_loads_within_the_budget_on_meta(core, name):
    model, _ = tiny_sample(name)
    budget = 40_000
    patcher = streamwise.model_patcher(model.eval(), load_device=META, offload_device=CPU, policy="auto")
    patcher.load(META, lowvram_model_memory=budget)
    placed = {id(p): p for p in model.parameters() if p.is_meta}
    assert sum(p.nbytes for p in placed.values()) <= budget  # what streams counts against the budget
    claimed = claimed_by_containers(model)
    assert [path for path in stranded(model) if id(model.get_submodule(path.rsplit(".", 1)[0])) not in claimed] == []


@pytest.mark.parametrize("name", ON_META)
def test_any_model_by_auto_computes_on_the_meta_load_device(core, name):
    model, inputs = tiny_sample(name)
    patcher = streamwise.model_patcher(model.eval(), load_device=META, offload_device=CPU, policy="auto")
    patcher.load(META, lowvram_model_memory=40_000)
    out = model(**{key: value.to(META) for key, value in inputs.items()})
    assert (out if isinstance(out, torch.Tensor) else out.logits).is_meta  # every tensor reached the device


@pytest.mark.parametrize("name, key", [
    ("gemma", "model.layers.0.input_layernorm.weight"),  # a generic leaf (1 + w RMSNorm)
    ("gemma", "model.layers.1.mlp.down_proj.weight"),  # a specific kind (linear)
    ("gpt2", "transformer.h.0.mlp.c_fc.weight"),  # generic: GPT-2's transposed Conv1D
    ("moe", "model.layers.0.self_attn.q_norm.weight"),  # a proven llama_rms_norm beside generic experts
])
def test_lora_patches_apply_to_any_model_by_auto(core, name, key):
    original, inputs = tiny_sample(name)
    original.eval()
    torch.manual_seed(1)
    diff = torch.randn_like(original.get_parameter(key)) * 0.05
    with torch.no_grad():
        expected = lora_reference(original, key, diff)(**inputs)
    expected = expected if isinstance(expected, torch.Tensor) else expected.logits
    model = copy.deepcopy(original)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="auto")
    assert patcher.add_patches({key: ("diff", (diff,))}, 1.0) == [key]
    patcher.load(CPU, lowvram_model_memory=10_000)
    with torch.no_grad():
        out = model(**inputs)
    assert torch.allclose(out if isinstance(out, torch.Tensor) else out.logits, expected, atol=1e-5)
    if model.get_submodule(key.rsplit(".", 1)[0]).comfy_cast_weights:  # streamed: never patched in place
        assert torch.equal(model.get_parameter(key), original.get_parameter(key))


def test_a_tree_of_native_comfy_layers_is_accepted_as_it_is(core):
    ops = core.ops.disable_weight_init
    model = torch.nn.Sequential(ops.Linear(8, 8), torch.nn.GELU(), ops.Linear(8, 4)).eval()
    for layer in (model[0], model[2]):
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    x = torch.randn(2, 8)
    expected = model(x)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="auto")
    plan = applied_state(model).plan
    assert plan.policy == "any-module" and plan.modules == () and plan.coverage.bytes["stranded"] == 0
    assert type(model[0]) is ops.Linear  # core's own layer, untouched
    patcher.load(CPU, lowvram_model_memory=200)
    assert model[0].comfy_cast_weights or model[2].comfy_cast_weights  # core streams them itself
    assert torch.equal(model(x), expected)


def _siglip():
    import transformers as T

    torch.manual_seed(0)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = T.SiglipConfig(text_config=dict(layers, vocab_size=64, max_position_embeddings=16, bos_token_id=1,
                                             eos_token_id=2, pad_token_id=0),
                            vision_config=dict(layers, image_size=16, patch_size=8))
    return T.SiglipModel(config), {"input_ids": torch.tensor([[1, 5, 9, 2]]), "pixel_values": torch.randn(1, 3, 16, 16)}


def _patched_keys(name: str, model) -> list[str]:
    """Keys a LoRA of every Linear (and Conv1d) weight patches, plus the direct parameters of containers."""
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    tied = {key for key, count in counts.items() if count > 1}  # a tied weight is patched under one key only
    layers = [path for path, module in model.named_modules()
              if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)) and id(module.weight) not in tied]
    extra = {"state-space": ["backbone.layers.0.mixer.A_log", "backbone.layers.1.mixer.D",
                             "backbone.layers.0.mixer.dt_proj.bias"],  # a parent reads these directly
             "custom": ["blocks.0.gamma", "blocks.1.gamma"],  # a generic container's own parameters
             "siglip": ["logit_scale", "logit_bias"]}[name]  # the root's own, relocated
    return [f"{path}.weight" for path in layers] + extra


@pytest.mark.parametrize("name", ["state-space", "custom", "siglip"])
@pytest.mark.parametrize("budget", [1, 20_000, None])
def test_patches_apply_wherever_a_weight_is_read_at_any_budget(core, name, budget):
    """Core merges a patch per module key; a parent reading a child's weight directly (Mamba's mixer), a container's
    own parameters and the root's must give the merged numbers at every budget, as leaves do."""
    original, inputs = _siglip() if name == "siglip" else tiny_sample(name)
    original.eval()
    torch.manual_seed(1)
    keys = _patched_keys(name, original)
    diffs = {key: torch.randn_like(original.get_parameter(key)) * 0.1 for key in keys}
    merged = copy.deepcopy(original)
    with torch.no_grad():
        for key, diff in diffs.items():
            merged.get_parameter(key).add_(diff)
        expected, unpatched = merged(**inputs), original(**inputs)
    model = copy.deepcopy(original)
    patcher = streamwise.model_patcher(model, load_device=CPU, offload_device=CPU, policy="auto")
    assert sorted(patcher.add_patches({key: ("diff", (diff,)) for key, diff in diffs.items()}, 1.0)) == sorted(keys)
    if budget is None:
        patcher.load(CPU, full_load=True)
    else:
        patcher.load(CPU, lowvram_model_memory=budget)
    with torch.no_grad():
        out = model(**inputs)
    field = "logits_per_image" if name == "siglip" else "logits"
    pick = (lambda o: o) if name == "custom" else (lambda o: getattr(o, field))
    assert not torch.allclose(pick(unpatched), pick(expected), atol=1e-3)  # the patches matter
    assert torch.allclose(pick(out), pick(expected), atol=1e-5, rtol=1e-5)
    patcher.unpatch_model(CPU)
    with torch.no_grad():
        assert torch.allclose(pick(model(**inputs)), pick(unpatched), atol=1e-6)  # unpatched again, exactly
