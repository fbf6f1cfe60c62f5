"""A quantized resident's `weight` as model code sees it: the float weight it stands for.

Modules whose forward reads their child Linear's weight directly (its dtype, shape, `.T`, `.to(dtype)`,
`F.linear(x, weight)`), as transformers' modeling code does, compute within the format's error of the float module
under every quant format; writes are refused; device moves, `deepcopy`, `state_dict` and pickling keep the raw
storage; a cast of the model changes the dtype the weight shows, never the storage; a compiled block reading the
weight's dtype breaks no graph.
"""

from __future__ import annotations

import copy
import io

import gguf
import pytest
import torch
import torch.nn.functional as F
import transformers
from quantized_zoo import ENVELOPE as STACKED
from quantized_zoo import cosine
from torch import nn

import streamwise
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
from streamwise.runtime.quant.quantized_weight import QuantizedWeight

from helpers import gguf_policy, make_policy, stream_rule

IN, OUT = 256, 64  # every format's blocks fit: GGUF's 32 and 256, INT4's groups
ENVELOPE = {"int8": 0.999, "convrot_int8": 0.999, "convrot_int4": 0.99, "gguf": 0.999}
"""Cosine similarity with the float module's output each format stays within (Q8_0 for GGUF): one quantized layer, so
stricter at 4 bits than the zoo's whole stacks (`quantized_zoo.ENVELOPE`)."""


class DirectReads(nn.Module):
    """A block whose forward reads `proj.weight` in each way transformers' modeling code does."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.proj, self.read = nn.Linear(IN, OUT, bias=False), read

    def forward(self, x):
        weight = self.proj.weight
        if self.read == "T5 guard":  # cast to the weight's dtype unless int8 (transformers' T5DenseActDense)
            if isinstance(weight, torch.Tensor) and x.dtype != weight.dtype and weight.dtype != torch.int8:
                x = x.to(weight.dtype)
            return self.proj(x)
        if self.read == "F.linear":  # MoE routers
            return F.linear(x.to(weight.dtype), weight)
        if self.read == ".T":  # FalconLinear, tied heads
            return x @ weight.T
        if self.read == ".to(dtype)":
            return x @ weight.to(torch.float64).t().float()
        if self.read == ".float() and shape":
            return (x @ weight.float().t()).reshape(-1, weight.shape[0])
        raise KeyError(self.read)


READS = ["T5 guard", "F.linear", ".T", ".to(dtype)", ".float() and shape"]


def _quantized(module: nn.Module, fmt: str, tmp_path, build=None) -> nn.Module:
    """`module` with its Linear made a resident of `fmt`: by a policy in memory, or for GGUF through the file
    `streamwise quantize` writes (Q8_0), loaded back."""
    if fmt != "gguf":
        rule = {"id": "q", "select": {"class": "Linear"}, "format": fmt}
        if fmt.startswith("convrot"):
            rule["group_size"] = 64
        policy = make_policy(stream={"rule": [stream_rule("l", "linear", **{"class": "Linear"})]},
                             quant={"rule": [rule]})
        streamwise.apply(streamwise.resolve(policy, module), module)
        return module
    from safetensors.torch import save_model

    save_model(module, tmp_path / "float.safetensors")  # a tied weight once
    policy = gguf_policy(tmp_path, "Q8_0", "any-module")
    quantize_to_gguf(tmp_path / "float.safetensors", tmp_path / "q.gguf", policy, module)
    with streamwise.skeleton():
        loaded = build() if build is not None else DirectReads(module.read)
    streamwise.load(loaded, tmp_path / "q.gguf", policy)
    return loaded


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("fmt", list(ENVELOPE))
def test_model_code_reading_a_quantized_weight_computes_within_the_formats_error(tmp_path, fmt, read):
    torch.manual_seed(0)
    float_module = DirectReads(read).eval()
    x = torch.randn(4, IN)
    with torch.no_grad():
        expected = float_module(x)
    module = _quantized(copy.deepcopy(float_module), fmt, tmp_path)
    stored = module.proj._parameters["weight"]
    assert stored.dtype in (torch.int8, torch.uint8) and isinstance(module.proj.weight, QuantizedWeight)
    assert module.proj.weight.dtype == torch.float32 and module.proj.weight.shape == (OUT, IN)
    assert module.proj.weight.size(1) == IN and module.proj.weight.ndim == 2
    with torch.no_grad():
        got = module(x)
    assert got.dtype == expected.dtype and cosine(got, expected) >= ENVELOPE[fmt], (fmt, read)
    assert module.proj._parameters["weight"] is stored  # a read never replaces the storage


@pytest.mark.parametrize("fmt", list(ENVELOPE))
def test_a_write_into_a_quantized_weight_is_refused(tmp_path, fmt):
    module = _quantized(DirectReads("F.linear"), fmt, tmp_path)
    stored = module.proj._parameters["weight"].clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match=f"`add_` writes into .* a `{fmt}` quantized weight"):
        module.proj.weight.add_(1)
    assert torch.equal(module.proj._parameters["weight"], stored)


@pytest.mark.parametrize("fmt", list(ENVELOPE))
@pytest.mark.parametrize("write", ["`.data =`", "a float Parameter", "`load_state_dict(assign=True)`"])
def test_a_replacement_a_quantized_weight_cannot_keep_is_refused_naming_the_module(tmp_path, fmt, write):
    module = _quantized(DirectReads("F.linear"), fmt, tmp_path)
    stored = module.proj._parameters["weight"]
    floats = torch.randn(OUT, IN)
    refused, said = streamwise.Error, rf"`proj\.weight`, a `{fmt}` quantized weight.*keep the layer float"
    if "load_state_dict" in write:  # torch says it: a storage of another shape (INT4's packed), or wraps ours
        refused, said = RuntimeError, rf"proj\.weight.*(shape|{said})"
    with pytest.raises(refused, match=said):
        if write == "`.data =`":
            module.proj.weight.data = floats
        elif write == "a float Parameter":
            module.proj.weight = nn.Parameter(floats)
        else:
            module.load_state_dict({"proj.weight": floats}, strict=False, assign=True)
    assert module.proj._parameters["weight"] is stored
    with torch.no_grad():
        module(torch.randn(2, IN))  # still computes


def _tied_lm(tie: bool) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=IN, intermediate_size=IN, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("fmt", list(ENVELOPE))
def test_tie_weights_on_a_tied_model_under_a_quant_rule(tmp_path, fmt):
    """GGUF keeps the tie: a tied head loads as the embedding's own float values (one stored tensor, read once), so
    transformers' `tie_weights()` changes nothing. A rule quantizing the head of a tied model cannot keep it: refused,
    with the advice, and the model still computes as before."""
    model = _quantized(_tied_lm(tie=True), fmt, tmp_path, build=lambda: _tied_lm(tie=True))
    ids = torch.tensor([[1, 5, 9, 33]])
    head = model.lm_head._parameters["weight"]
    with torch.no_grad():
        before = model(ids).logits
    if fmt == "gguf":
        assert head is model.model.embed_tokens.weight and head.is_floating_point()
        model.tie_weights()
    else:
        assert head.dtype in (torch.int8, torch.uint8)  # the rule quantized the head
        with pytest.raises(streamwise.Error, match=r"`lm_head\.weight`.*tie_word_embeddings = False"):
            model.tie_weights()
    assert model.lm_head._parameters["weight"] is head
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("fmt", list(ENVELOPE))
def test_moves_copies_and_state_dicts_keep_the_raw_storage(tmp_path, fmt):
    module = _quantized(DirectReads("T5 guard"), fmt, tmp_path)
    x = torch.randn(2, IN)
    with torch.no_grad():
        expected = module(x)
    stored = {k: v.clone() for k, v in module.state_dict().items()}
    assert stored["proj.weight"].dtype in (torch.int8, torch.uint8)  # the storage, as the file and core see it
    storage = sum(t.nbytes for t in module.proj._parameters.values() if t is not None)
    assert module.proj.weight.nbytes == storage - getattr(module.proj.bias, "nbytes", 0) < OUT * IN * 4
    plan = streamwise.resolve(make_policy(stream={"rule": [stream_rule("l", "linear", **{"class": "Linear"})]}),
                              module)
    assert sum(plan.coverage.bytes.values()) == storage  # budgets and coverage count the storage

    module.to("cpu")  # torch's `_apply`: the storage moves as it is
    duplicate = copy.deepcopy(module)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    unpickled = torch.load(buffer, weights_only=False)
    for other in (module, duplicate, unpickled):
        assert other.state_dict().keys() == stored.keys()
        assert all(torch.equal(other.state_dict()[k], v) for k, v in stored.items())
        assert isinstance(other.proj.weight, QuantizedWeight)
        with torch.no_grad():
            assert torch.equal(other(x), expected)


def test_a_cast_of_the_model_changes_the_dtype_its_weights_show_not_their_storage(tmp_path):
    module = _quantized(DirectReads("T5 guard"), "int8", tmp_path)
    module.to(torch.bfloat16)
    assert module.proj.weight.dtype == torch.bfloat16 and module.proj._parameters["weight"].dtype == torch.int8
    with torch.no_grad():
        assert module(torch.randn(2, IN)).dtype == torch.bfloat16  # the guard cast its input to bfloat16
    module.float()
    assert module.proj.weight.dtype == torch.float32


@pytest.mark.parametrize("fmt", list(ENVELOPE))
def test_the_dtype_shown_is_the_float_weights_it_replaces(tmp_path, fmt):
    module = DirectReads("T5 guard").to(torch.bfloat16)
    if fmt == "gguf":  # through the file: the load's dtype is the model's
        from safetensors.torch import save_file

        save_file(module.state_dict(), tmp_path / "float.safetensors")
        policy = gguf_policy(tmp_path, "Q8_0", "any-module")
        quantize_to_gguf(tmp_path / "float.safetensors", tmp_path / "q.gguf", policy, module)
        with streamwise.skeleton():
            module = DirectReads("T5 guard").to(torch.bfloat16)
        streamwise.load(module, tmp_path / "q.gguf", policy, dtype=torch.bfloat16)
    else:
        module = _quantized(module, fmt, tmp_path)
    assert module.proj.weight.dtype == torch.bfloat16 and not module.proj._parameters["weight"].is_floating_point()


class TimeEmbedding(nn.Module):
    """Casts its input to its first parameter's dtype, as diffusers' Wan and Stable Audio time embedders do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(IN, OUT), nn.Linear(OUT, OUT)

    def forward(self, x):
        x = x.to(next(iter(self.parameters())).dtype)
        return self.linear_2(F.silu(self.linear_1(x)))


@pytest.mark.parametrize("fmt", list(ENVELOPE))
def test_code_taking_a_residents_first_parameter_for_its_dtype_gets_the_compute_dtype(tmp_path, fmt):
    torch.manual_seed(0)
    module = TimeEmbedding()
    x = torch.randn(4, IN)
    with torch.no_grad():
        expected = module(x)
        quantized = _quantized(copy.deepcopy(module), fmt, tmp_path, build=TimeEmbedding)
        got = quantized(x)
    assert next(iter(quantized.parameters())).dtype == torch.float32
    assert cosine(got, expected) >= STACKED[fmt if fmt != "gguf" else "Q8_0"]  # two layers: the zoo's envelope
    assert not quantized.linear_1._parameters["weight"].is_floating_point()  # quantized, its bias first


def test_a_compiled_block_reading_a_quantized_weights_dtype_breaks_no_graph(tmp_path):
    module = _quantized(DirectReads("T5 guard"), "int8", tmp_path)
    x = torch.randn(2, IN)
    with torch.no_grad():
        expected = module(x)
        explained = torch._dynamo.explain(module)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert torch.allclose(torch.compile(module, fullgraph=True)(x), expected, rtol=1e-4, atol=1e-5)


def test_a_gguf_t5_computes_within_q8_0_error_of_the_float_model(tmp_path):
    """T5's feed-forward casts its activations to `wo.weight.dtype`: the raw uint8 storage made it garbage."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=1, eos_token_id=2)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "t5")
    quantize_to_gguf(tmp_path / "t5" / "model.safetensors", tmp_path / "t5" / "model.Q8_0.gguf",
                     gguf_policy(tmp_path, "Q8_0", "transformers"), model)
    loaded = streamwise.load_pretrained(tmp_path / "t5" / "model.Q8_0.gguf", progress=False)
    assert loaded.report.quantized and set(loaded.report.quantized.values()) == {gguf.GGMLQuantizationType.Q8_0.name}
    inputs = dict(input_ids=torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), decoder_input_ids=torch.tensor([[0, 7, 3]]))
    with torch.no_grad():
        assert cosine(loaded.model(**inputs).logits, model(**inputs).logits) >= ENVELOPE["gguf"]
