"""apply / revert: in place, no copies, idempotent, atomic, reversible, meta-safe, per tree."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import transformers

import streamwise
from streamwise.runtime.convert import ConversionError, applied_state, apply_policy
from streamwise.runtime.engine.relocating import offload_relocated

from helpers import force_streaming, make_policy, stream_rule, tiny_acoustic_tokenizer, tiny_qwen2

# the module: the package exports the function
apply_module = importlib.import_module("streamwise.runtime.convert.apply")

DECODER = streamwise.load_policy("decoder-llm")


def snapshot_tree(model):
    return [(name, type(m), sorted(m.__dict__)) for name, m in model.named_modules()]


def convert(model, policy=DECODER):
    return streamwise.apply(streamwise.resolve(policy, model), model)


def test_conversion_copies_no_tensor_and_keeps_the_state_dict():
    model = tiny_qwen2()
    before = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    convert(model)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)


def test_apply_is_idempotent():
    model = tiny_qwen2()
    first = convert(model)
    tree = snapshot_tree(model)
    assert convert(model) == first
    assert snapshot_tree(model) == tree
    assert first.streamed == {"embedding": 1, "linear": 15, "llama_rms_norm": 5} and first.relocating == 1


def test_the_state_keeps_the_plan_applied_last():
    model = tiny_qwen2()
    first, second = streamwise.resolve(DECODER, model), streamwise.resolve(DECODER, model)
    streamwise.apply(first, model)
    streamwise.apply(second, model)
    assert applied_state(model).plan is second


def test_revert_restores_classes_and_attributes_exactly():
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (1, 6))
    expected = model(ids).logits
    before = snapshot_tree(model)
    convert(model)
    force_streaming(model)
    model(ids)
    streamwise.revert(model)
    assert snapshot_tree(model) == before
    assert torch.equal(model(ids).logits, expected)
    with pytest.raises(ConversionError):
        streamwise.revert(model)


def test_revert_gives_back_attributes_the_instance_held_before():
    model = tiny_qwen2()
    leaf, neighbour = model.model.layers[0].mlp.up_proj, model.model.layers[0].mlp.down_proj  # one class
    leaf.weight_function = ["the caller's own"]
    convert(model)
    assert leaf.weight_function == [] and neighbour.weight_function == ()
    neighbour.weight_function = ["a host's patch"]
    streamwise.revert(model)
    assert leaf.weight_function == ["the caller's own"]
    assert "weight_function" not in vars(neighbour) and not hasattr(neighbour, "weight_function")


def test_the_resting_values_on_a_leaf_class_cannot_be_patched_for_every_leaf():
    model = tiny_qwen2()
    convert(model)
    leaf = model.lm_head
    assert "weight_function" not in vars(leaf) and not leaf.comfy_cast_weights
    with pytest.raises(AttributeError):
        leaf.weight_function.append(lambda weight: weight)  # a host assigns its own list first, as core does


def test_a_leaf_with_a_forward_of_its_own_is_refused():
    import types

    model = tiny_qwen2()
    leaf = model.model.layers[0].mlp.up_proj
    leaf.forward = types.MethodType(torch.nn.Linear.forward, leaf)  # as a hook library installs it
    before = snapshot_tree(model)
    with pytest.raises(ConversionError, match="`model.layers.0.mlp.up_proj` has a forward of its own"):
        convert(model)
    assert snapshot_tree(model) == before


def test_apply_policy_converts_as_resolve_then_apply_does_and_checks_the_same():
    import types

    one, other = tiny_qwen2(), tiny_qwen2()
    convert(one)
    policy, plan = streamwise.apply_policy(other, DECODER)  # one walk serves resolve and apply
    assert policy is DECODER and plan == streamwise.resolve(DECODER, other)
    assert [(n, type(m), sorted(m.__dict__)) for n, m in other.named_modules()] == snapshot_tree(one)
    assert applied_state(other).counts() == applied_state(one).counts()

    hooked = tiny_qwen2()
    leaf = hooked.model.layers[1].self_attn.o_proj
    leaf.forward = types.MethodType(torch.nn.Linear.forward, leaf)
    before = snapshot_tree(hooked)
    with pytest.raises(ConversionError, match="`model.layers.1.self_attn.o_proj` has a forward of its own"):
        streamwise.apply_policy(hooked, DECODER)
    assert snapshot_tree(hooked) == before


def test_converted_trees_pickle_and_keep_their_classes():
    import io

    torch.manual_seed(0)
    model = tiny_qwen2()
    rule = {"id": "q", "select": {"path": "model.layers.0.mlp.*"}, "format": "int8"}
    quant = make_policy(quant={"rule": [rule]}).quant
    convert(model, DECODER.model_copy(update={"quant": quant}))
    ids = torch.tensor([[1, 2, 3]])
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, as torch.save(model) users and multiprocessing do
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    for name, module in model.named_modules():
        assert type(loaded.get_submodule(name)) is type(module)  # the same cached derived classes
    assert applied_state(loaded) is not None


@pytest.mark.parametrize("failure, raised, match", [
    (RuntimeError("disk on fire"), ConversionError, "disk on fire.*restored unchanged"),
    (KeyboardInterrupt(), KeyboardInterrupt, None),  # restored, and still an interrupt
])
def test_a_failure_midway_restores_the_tree(monkeypatch, failure, raised, match):
    model = tiny_qwen2()
    before = snapshot_tree(model)
    real_swap, calls = apply_module.swap_class, []

    def failing_swap(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise failure
        return real_swap(*args, **kwargs)

    monkeypatch.setattr(apply_module, "swap_class", failing_swap)
    with pytest.raises(raised, match=match) as caught:
        convert(model)
    assert type(caught.value) is raised
    assert snapshot_tree(model) == before
    assert applied_state(model) is None


def test_problems_are_found_before_anything_changes():
    qwen, other = tiny_qwen2(), tiny_qwen2(num_hidden_layers=1)
    plan = streamwise.resolve(DECODER, qwen)
    before = snapshot_tree(other)
    with pytest.raises(ConversionError, match="does not have"):
        streamwise.apply(plan, other)
    assert snapshot_tree(other) == before

    wrong_kind = make_policy(stream={"rule": [stream_rule("norms", "layer_norm", **{"class": "Qwen2RMSNorm"})]})
    plan = streamwise.resolve(wrong_kind, other)  # caught when resolving: `policy-validate --model` shows it
    assert [d.code for d in plan.diagnostics if d.is_error] == ["kind-mismatch"]
    assert "`Qwen2RMSNorm` has no bias, normalized_shape, eps, which kind `layer_norm` reads (3 modules: " in (
        plan.diagnostics[0].message)
    # and by apply itself, for a plan that was edited after resolving
    fine = streamwise.resolve(DECODER, other)
    edited = dataclasses.replace(fine, modules=tuple(
        entry._replace(stream="layer_norm") if entry.stream == "llama_rms_norm" else entry for entry in fine.modules))
    with pytest.raises(ConversionError, match="cannot compute as `layer_norm`: it has no bias, normalized_shape, eps"):
        streamwise.apply(edited, other)
    assert snapshot_tree(other) == before


def test_a_plan_with_errors_is_refused():
    model = tiny_qwen2()
    policy = make_policy(stream={"rule": [stream_rule("ghost", "linear", **{"class": "GhostLinear"})]})
    with pytest.raises(ConversionError, match="unmatched-rule"):
        convert(model, policy)


def test_conversion_works_on_the_meta_device_at_full_size():
    with torch.device("meta"):
        model = transformers.VibeVoiceForConditionalGeneration(transformers.VibeVoiceConfig())
    census = convert(model, streamwise.load_policy("vibevoice"))
    assert census.streamed == {
        "conv1d": 96, "conv_transpose1d": 6, "embedding": 1, "linear": 407, "llama_rms_norm": 227,
    }
    assert census.relocating == 81
    assert all(p.is_meta for p in model.parameters())


def test_relocated_tensors_follow_their_trees_compute_device_even_outside_forward():
    tokenizer = tiny_acoustic_tokenizer()
    convert(tokenizer, streamwise.load_policy("vibevoice"))
    layer = next(m for m in tokenizer.modules() if type(m).__name__.startswith("Relocating"))
    gamma = layer._parameters["gamma"]
    applied_state(tokenizer).tree.compute_device = torch.device("meta")
    assert layer.gamma is gamma and gamma.is_meta  # moved in place by a plain attribute read
    assert layer.norm.weight.device.type == "cpu"  # streamed leaves are the host's business


def test_two_trees_keep_their_own_compute_device():
    on_cpu, elsewhere = tiny_qwen2(), tiny_qwen2()
    convert(on_cpu)
    convert(elsewhere)
    applied_state(elsewhere).tree.compute_device = torch.device("meta")
    force_streaming(on_cpu)
    on_cpu(torch.randint(0, 128, (1, 4)))  # streams on the CPU: its tree learns "cpu"
    assert applied_state(on_cpu).tree.compute_device == torch.device("cpu")
    assert applied_state(elsewhere).tree.compute_device == torch.device("meta")
    assert on_cpu.model.rotary_emb.inv_freq.device.type == "cpu"
    assert elsewhere.model.rotary_emb.inv_freq.is_meta


def test_offloading_relocated_tensors_sends_them_back(monkeypatch):
    model = tiny_qwen2()
    convert(model)
    moved = []
    monkeypatch.setattr("streamwise.runtime.engine.relocating.move_in_place",
                        lambda module, name, device: moved.append((name, device)))
    offload_relocated(model, torch.device("cpu"))
    assert moved == []  # already there
    offload_relocated(model, torch.device("meta"))
    assert moved == [("inv_freq", torch.device("meta")), ("original_inv_freq", torch.device("meta"))]


def test_a_converted_root_is_freed_by_reference_counting_alone():
    """The root holds its state, whose records would hold the root: the root's record holds it weakly, so no cycle
    keeps a dropped model alive until a full collection."""
    import gc
    import weakref

    root = torch.nn.Linear(4, 4)
    streamwise.apply_policy(root, "any-module")
    assert type(root) is not torch.nn.Linear
    alive = weakref.ref(root)
    gc.disable()
    try:
        del root
        assert alive() is None
    finally:
        gc.enable()


def test_converting_again_differently_names_the_module_its_class_and_both_policies():
    model = tiny_qwen2()
    apply_policy(model, "decoder-llm")
    generic = make_policy(stream={"rule": [stream_rule("g", "generic", **{"class": "Linear"})]})
    with pytest.raises(ConversionError, match=r"^`model.layers.0.self_attn.q_proj` \(Linear\) was already converted "
                                              r"differently: linear \(StreamedLinear\) by policy `decoder-llm`, where "
                                              r"policy `test` asks for generic\. Convert a copy"):
        apply_policy(model, generic)
