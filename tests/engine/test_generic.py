"""Any model, safely: the generic kind, `kind = "auto"`, kinds proven against their class, the catch-all policies.

Numerics run on tiny real configs at budget 0 (every streamed module fetches on each call): the converted model
must equal the unconverted one bit for bit. The three ways a hand-written policy used to compute silently wrong
numbers (GPT-2's transposed Conv1D as `linear`, Gemma's `1 + w` RMSNorm as `llama_rms_norm`, Gemma's scaled
embedding as `embedding`) are refused before anything changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import streamwise
from streamwise.runtime.convert import ConversionError, applied_state
from streamwise.runtime.engine import protocol
from streamwise.runtime.engine.kinds import fit
from streamwise.runtime.engine.tree import TorchFetcher
from streamwise.runtime.plan.auto import select_policy

from helpers import SAMPLE, LayerScaleNorm, force_streaming, make_policy, stream_rule
from helpers import tiny_sample as _tiny

LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def _output(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("name", SAMPLE)
def test_auto_streams_the_sample_at_budget_zero_bit_for_bit(name):
    model, inputs = _tiny(name)
    model.eval()
    expected = _output(model, inputs)
    policy = select_policy(model).policy
    plan = streamwise.resolve(policy, model)
    assert plan.ok and plan.coverage.stranded == () and plan.coverage.bytes["stranded"] == 0
    report = streamwise.offload(model, policy, device="cpu", budget=0)
    assert report.resident_modules == 0 and report.streamed_modules > 0
    fetching = [m for m in model.modules() if protocol.kind_of(m) is not None]
    assert fetching and all(protocol.is_fetching(m) for m in fetching)  # every streamed module takes the fetch
    assert torch.equal(_output(model, inputs), expected)


def test_auto_chooses_a_specific_kind_only_where_it_is_proven_and_says_why():
    model, _ = _tiny("gemma")
    plan = streamwise.resolve(streamwise.load_policy("transformers"), model)
    by_class = {entry.class_name.rsplit(".", 1)[-1]: entry for entry in plan.modules if entry.stream}
    assert by_class["Linear"].stream == "linear"
    assert by_class["Linear"].kind_reason == "auto: `linear` reproduces `Linear`"
    assert by_class["GemmaRMSNorm"].stream == "generic"  # scales by 1 + w: no specific kind reproduces it
    assert by_class["GemmaTextScaledWordEmbedding"].stream == "generic"  # overrides Embedding.forward
    assert "no specific kind is proven for `GemmaRMSNorm`" in by_class["GemmaRMSNorm"].kind_reason
    dense, _ = _tiny("dense")
    entry = next(e for e in streamwise.resolve(streamwise.load_policy("transformers"), dense).modules
                 if e.class_name.endswith("Qwen3RMSNorm"))
    assert entry.stream == "llama_rms_norm"  # a verbatim copy of LlamaRMSNorm.forward is proven


def test_fit_proves_from_the_class_alone():
    class Plain(nn.Linear):
        pass

    class Scaled(nn.Embedding):
        def forward(self, x):
            return super().forward(x) * 2

    assert fit("auto", Plain).kind == "linear" and fit("linear", Plain).proven
    assert fit("auto", Scaled).kind == "generic"
    class Rewritten(nn.Conv1d):  # overrides both methods `conv1d` computes: the first in the kind's list is named
        def forward(self, x):
            return self._conv_forward(x, self.weight, self.bias)

        def _conv_forward(self, x, weight, bias):
            return super()._conv_forward(x, weight * 2, bias)

    assert fit("embedding", Scaled).refused is not None and "overrides `forward` of `Embedding`" in (
        fit("embedding", Scaled).refused)
    assert not fit("embedding", Scaled).proven  # refused: no probe could make it stand
    assert "`Rewritten` overrides `forward` of `Conv1d`" in fit("conv1d", Rewritten).refused
    assert fit("generic", Scaled).proven and fit("auto", LayerScaleNorm)[:3] == (
        "generic", True, "auto: no specific kind is proven for `LayerScaleNorm`; its own forward")
    named = fit("linear", LayerScaleNorm, named=True)  # a deliberate claim: probed on real weights
    assert (named.kind, named.proven, named.refused) == ("linear", False, None)
    look_alike = fit("linear", LayerScaleNorm)  # selected by a short name: computes with its own forward
    assert (look_alike.kind, look_alike.proven) == ("generic", True) and "look-alike" in look_alike.note


def _conv1d_model(square: bool) -> nn.Module:
    torch.manual_seed(0)
    config = T.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=32)
    model = T.GPT2LMHeadModel(config).eval()
    return model if square else model


@pytest.mark.parametrize("select, shape", [("c_proj", "square"), ("c_attn", "non-square")])
def test_linear_on_gpt2_conv1d_is_refused_by_the_probe(select, shape):
    model = _conv1d_model(square=True)
    rules = [stream_rule("conv1d-as-linear", "linear", path=f"transformer.h.0.attn.{select}")]
    policy = make_policy(stream={"rule": rules})
    plan = streamwise.resolve(policy, model)
    assert plan.ok  # nothing in the class tells: Conv1D is no Linear
    before = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ConversionError, match=(
            rf"stream rule `conv1d-as-linear` .* computes `transformer.h.0.attn.{select}` \(Conv1D\) as `linear`, "
            r"which does not reproduce the class: ")) as raised:
        streamwise.apply(plan, model)
    if shape == "square":
        assert "differs from the class's own forward by" in str(raised.value)
    assert [(n, type(m)) for n, m in model.named_modules()] == before and applied_state(model) is None


def _gemma_with_real_norms():
    model, inputs = _tiny("gemma")
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "GemmaRMSNorm":
                module.weight.normal_()  # Gemma's weights start at 0, where 1 + w and w * 1 still differ
    return model, inputs


def test_llama_rms_norm_named_for_gemma_rms_norm_is_refused_by_the_probe():
    model, _ = _gemma_with_real_norms()
    qualified = "transformers.models.gemma.modeling_gemma.GemmaRMSNorm"
    policy = make_policy(stream={"rule": [stream_rule("norms", "llama_rms_norm", **{"class": qualified})]})
    plan = streamwise.resolve(policy, model)
    assert plan.ok
    with pytest.raises(ConversionError, match=r"\(GemmaRMSNorm\) as `llama_rms_norm`, which does not reproduce the "
                                              r"class: `llama_rms_norm` differs .* by [0-9.]+"):
        streamwise.apply(plan, model)


def test_llama_rms_norm_on_a_look_alike_selected_by_short_name_computes_its_own_forward():
    model, inputs = _gemma_with_real_norms()
    expected = _output(model, inputs)
    policy = make_policy(stream={"rule": [stream_rule("norms", "llama_rms_norm", **{"class": "GemmaRMSNorm"})]})
    plan = streamwise.resolve(policy, model)
    (note,) = [d for d in plan.diagnostics if d.code == "unproven-kind"]
    assert note.severity == "warning" and "GemmaRMSNorm` is not a class `llama_rms_norm` is proven for (a " \
        "look-alike), so it computes with its own forward (`generic`)" in note.message
    assert {e.stream for e in plan.modules if e.class_name.endswith("GemmaRMSNorm")} == {"generic"}
    streamwise.apply(plan, model)
    force_streaming(model)
    assert torch.equal(_output(model, inputs), expected)


def test_embedding_with_subclasses_on_gemma_scaled_embedding_is_refused_when_resolving():
    with torch.device("meta"):  # no weights needed: the class itself shows it
        model = T.GemmaForCausalLM(T.GemmaConfig(hidden_size=64, intermediate_size=128, head_dim=16, **LAYERS))
    rule = stream_rule("embeddings", "embedding", **{"class": "Embedding"}, subclasses=True)
    plan = streamwise.resolve(make_policy(stream={"rule": [rule]}), model)
    (problem,) = [d for d in plan.diagnostics if d.is_error]
    assert problem.code == "kind-mismatch"
    assert problem.message.startswith("stream rule `embeddings`: `GemmaTextScaledWordEmbedding` overrides `forward` "
                                      "of `Embedding`")
    assert problem.message.endswith("(module: `model.embed_tokens`)")


def test_a_proven_kind_on_real_weights_is_not_refused():
    model, inputs = _tiny("dense")
    model.eval()
    expected = _output(model, inputs)
    policy = make_policy(stream={"rule": [
        stream_rule("norms", "llama_rms_norm", **{"class": "*RMSNorm"}),  # a class glob; Qwen3's is proven
        stream_rule("rest", "generic", holds="parameters"),
    ]})
    streamwise.offload(model, policy, device="cpu", budget=0)
    assert torch.equal(_output(model, inputs), expected)


def test_the_probe_leaves_the_random_state_alone():
    model = _conv1d_model(square=True)
    policy = make_policy(stream={"rule": [stream_rule("c", "linear", path="transformer.h.0.mlp.c_fc")]})
    plan = streamwise.resolve(policy, model)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    with pytest.raises(ConversionError):
        streamwise.apply(plan, model)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_generic_streaming_of_a_block_traces_without_graph_breaks():
    import torch._dynamo as dynamo

    model, _ = _tiny("moe")
    streamwise.apply_policy(model, "transformers")
    for module in model.modules():
        if protocol.kind_of(module) is not None:
            protocol.set_fetching(module, True)
    block = model.model.layers[0]
    assert {protocol.kind_of(m) for m in block.modules()} >= {"generic", "linear", "llama_rms_norm"}  # experts: generic
    x = torch.randn(1, 5, 64)
    position = (torch.ones(1, 5, 16), torch.zeros(1, 5, 16))
    explained = dynamo.explain(block)(x, position_embeddings=position)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]


def test_the_custom_module_relocates_its_buffers_and_streams_its_own_parameters():
    model, inputs = _tiny("custom")
    plan = streamwise.resolve(streamwise.load_policy("any-module"), model)
    block = plan.module("blocks.0")
    assert (block.stream, block.relocate) == ("generic", ("offset",))  # gamma streams, the buffer follows
    # the block's forward could read its children's parameters itself: it fetches them with its own (a child keeps
    # only a quant role: the shipped gguf-linears rule, which keeps a GGUF file's blocks in their storage)
    proj = plan.module("blocks.0.proj")
    assert plan.module("blocks.0.norm") is None and (proj.stream, proj.relocate, proj.quant) == (None, (), "gguf")
    assert plan.module("head").stream == "linear" and plan.module("embed").stream == "embedding"
    assert plan.coverage.bytes["relocated"] == 2 * 32 * 4 and plan.coverage.bytes["stranded"] == 0
    streamwise.apply(plan, model)
    assert protocol.claimed(model.blocks[0]) == (model.blocks[0].norm, model.blocks[0].proj)


def test_native_streaming_layers_are_left_as_they_are():
    class NativeLinear(nn.Linear):  # as ComfyUI's `comfy.ops` layers define it on the class
        comfy_cast_weights = False

    model = nn.Sequential(NativeLinear(4, 4), nn.LayerNorm(4))
    plan = streamwise.resolve(streamwise.load_policy("any-module"), model)
    assert [entry.path for entry in plan.modules] == ["1"] and plan.coverage.bytes["stranded"] == 0


def test_a_deepcopied_generic_model_still_computes_the_same():
    model, inputs = _tiny("custom")
    expected = _output(model, inputs)
    streamwise.offload(model, "any-module", device="cpu", budget=0)
    assert torch.equal(_output(copy.deepcopy(model), inputs), expected)


class _TrueValues(TorchFetcher):
    """Brings each parameter's true values while the stored ones are poisoned: a forward that reads a stored
    parameter instead of the fetched one gives NaN."""

    def __init__(self, true: dict[int, torch.Tensor]) -> None:
        self.true = true

    def fetch(self, module, device, dtype):
        weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
        return self.for_compute(module, self._true(weight), self._true(bias), device, dtype)

    def fetch_raw(self, module, names, device):
        return [self._true(module._parameters.get(name, module._buffers.get(name))) for name in names]

    def _true(self, tensor):
        return None if tensor is None else self.true.get(id(tensor), tensor)


class WeightNormed(nn.Module):
    """A vocoder-style stack: `weight_norm` derives each conv's weight from `weight_g` and `weight_v` in a hook."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.utils.weight_norm(nn.Conv1d(4, 4, 3, padding=1)) for _ in range(2)])

    def forward(self, x):
        for conv in self.convs:
            x = conv(x)
        return x


def _tiny_or_weight_normed(name: str) -> tuple[nn.Module, dict]:
    if name == "weight-norm":
        torch.manual_seed(0)
        return WeightNormed(), {"x": torch.randn(1, 4, 9)}
    return _tiny(name)


@pytest.mark.parametrize("name", ["moe", "gemma", "custom", "state-space", "weight-norm"])
def test_streamed_modules_compute_from_the_fetched_tensors_only(name):
    model, inputs = _tiny_or_weight_normed(name)
    model.eval()
    expected = _output(model, inputs)
    streamwise.offload(model, "auto" if name != "custom" else "any-module", device="cpu", budget=0)
    fetching = [m for m in model.modules() if protocol.kind_of(m) is not None]  # with what their containers claim
    streamed = {id(p): p for m in fetching + [c for m in fetching for c in protocol.claimed(m)]
                for p in m._parameters.values() if p is not None}
    true = {key: p.detach().clone() for key, p in streamed.items()}
    applied_state(model).tree.fetcher = _TrueValues(true)
    # the copies sit elsewhere in memory, which a vectorized kernel may sum in another order: the numbers they give
    # are the reference (within an ulp or so of the unconverted model's)
    fetched = _output(model, inputs)
    torch.testing.assert_close(fetched, expected)
    with torch.no_grad():
        for parameter in streamed.values():
            parameter.fill_(float("nan"))
    assert torch.equal(_output(model, inputs), fetched)


@pytest.mark.parametrize("name", ["state-space", "moe", "custom"])
def test_what_streams_generically_counts_against_the_standalone_budget(name):
    model, _ = _tiny(name)
    budget = 30_000
    report = streamwise.offload(model, "auto", device="cpu", budget=budget)
    resident = {id(p): p for leaf in model.modules() if protocol.kind_of(leaf) and not protocol.is_fetching(leaf)
                for owner in (leaf, *protocol.claimed(leaf)) for p in owner.parameters(recurse=False)}
    assert 0 < report.resident_bytes <= budget and sum(p.nbytes for p in resident.values()) == report.resident_bytes
    assert report.streamed_bytes + report.resident_bytes == sum(p.nbytes for p in model.parameters())


def test_quantized_layers_inside_a_generic_container_travel_as_their_storage():
    model, inputs = _tiny("state-space")  # Mamba: each mixer is a generic container over its Linear layers
    model.eval()
    # in_proj and out_proj, which the mixer calls (it reads dt_proj.weight itself: that one must stay float)
    rule = {"id": "q", "select": {"path": ["**.mixer.in_proj", "**.mixer.out_proj"]}, "format": "int8"}
    quant = make_policy(quant={"rule": [rule]}).quant
    policy = streamwise.load_policy("transformers").model_copy(update={"quant": quant})
    streamwise.offload(model, policy, device="cpu", budget=None)  # everything resident
    mixer = model.backbone.layers[0].mixer
    assert protocol.kind_of(mixer) == "generic" and protocol.is_resident(mixer.in_proj)
    resident = _output(model, inputs)
    streamed = [m for m in model.modules() if protocol.kind_of(m) is not None]
    for module in streamed:
        protocol.set_fetching(module, True)
    true = {id(p): p.detach().clone() for m in model.modules() for p in m._parameters.values() if p is not None}
    applied_state(model).tree.fetcher = _TrueValues(true)
    with torch.no_grad():
        for parameter in mixer.in_proj._parameters.values():
            if parameter is not None:
                parameter.zero_()  # the stored storage is read no more: the container fetched it
    assert torch.equal(_output(model, inputs), resident)


def test_an_unproven_kind_on_meta_is_a_warning_that_names_the_probe():
    with torch.device("meta"):
        model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32))
    named = "transformers.pytorch_utils.Conv1D"  # a deliberate claim: a short name would be a look-alike
    rules = [stream_rule("conv1d-as-linear", "linear", **{"class": named}), stream_rule("rest", "auto",
                                                                                        holds="parameters")]
    plan = streamwise.resolve(make_policy(stream={"rule": rules}), model)
    (warning,) = [d for d in plan.diagnostics if d.code == "unproven-kind"]
    assert plan.ok and warning.severity == "warning"
    assert warning.message.startswith("stream rule `conv1d-as-linear` computes `Conv1D` as `linear`, which nothing "
                                      "about the class proves; apply probes it on real weights (8 modules: ")


class Gated(nn.Module):
    """A module of no known kind, with a weight, a bias and one more parameter: streamed generically."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.bias = nn.Parameter(torch.randn(3))
        self.gate = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return (x @ self.weight.T + self.bias) * self.gate


def test_a_generic_module_gets_its_weight_and_bias_the_hosts_way_with_their_functions():
    """A host's patches (LoRA) reach `weight` and `bias` through the fetch, as for any streamed leaf."""
    model = nn.Sequential(Gated())
    x = torch.randn(2, 4)
    layer = model[0]
    with torch.no_grad():
        expected = (x @ (layer.weight * 2).T + (layer.bias + 1)) * layer.gate
    streamwise.offload(model, "any-module", device="cpu", budget=0)
    assert protocol.kind_of(layer) == "generic"
    layer.weight_function, layer.bias_function = [lambda w: w * 2], [lambda b: b + 1]
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_the_fetched_tensors_are_gone_after_the_call():
    model = nn.Sequential(Gated())
    streamwise.offload(model, "any-module", device="cpu", budget=0)
    model(torch.randn(2, 4))
    assert not {"weight", "bias", "gate"} & vars(model[0]).keys()  # the stored parameters are what it holds


class Rows(nn.Module):
    """A generic module whose forward takes no tensor: how many rows of its table to give."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 2))

    def forward(self, count: int):
        return self.table[:count] * 2


def test_a_generic_module_called_without_a_tensor_fetches_to_the_trees_compute_device():
    model = nn.Sequential(Rows())
    expected = model[0](3)
    streamwise.offload(model, "any-module", device="cpu", budget=0)
    assert protocol.kind_of(model[0]) == "generic"
    assert torch.equal(model[0](3), expected)
    applied_state(model).tree.compute_device = None  # converted, not yet placed by a host
    with pytest.raises(TypeError, match=r"^Rows\.forward\(\) got no tensor argument and its tree has no compute "
                                        r"device yet, so the device to fetch its weights to is unknown; relocate it"):
        model[0](3)
