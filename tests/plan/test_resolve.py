"""resolve: roles, precedence, coverage and diagnostics against real module trees."""

from __future__ import annotations

import pytest
import torch
import transformers

import streamwise
from streamwise.runtime.policy.diagnostics import render_text
from streamwise.runtime.sizes import human

from helpers import make_policy, stream_rule, tiny_acoustic_tokenizer, tiny_qwen2, write_policy


def on_meta(build):
    with torch.device("meta"):
        return build()


REAL_TREES = {
    "vibevoice-full-meta": (
        "vibevoice",
        lambda: on_meta(lambda: transformers.VibeVoiceForConditionalGeneration(transformers.VibeVoiceConfig())),
    ),
    "vibevoice-tokenizer-tiny": ("vibevoice", tiny_acoustic_tokenizer),
    "qwen2-full-meta": (
        "decoder-llm", lambda: on_meta(lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config())),
    ),
    "qwen2-tiny": ("decoder-llm", tiny_qwen2),
    "llama-full-meta": (
        "decoder-llm", lambda: on_meta(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig())),
    ),
    "mistral-full-meta": (
        "decoder-llm", lambda: on_meta(lambda: transformers.MistralForCausalLM(transformers.MistralConfig())),
    ),
}


@pytest.mark.parametrize("tree", sorted(REAL_TREES))
def test_shipped_policies_cover_real_trees_completely(tree, snapshot):
    policy_name, build = REAL_TREES[tree]
    plan = streamwise.resolve(streamwise.load_policy(policy_name), build())
    warnings = [d.code for d in plan.diagnostics]
    # the tokenizer alone has none of the language model's decoder layers, the policy's compile blocks
    assert plan.ok and warnings == (["unmatched-blocks"] if tree.startswith("vibevoice-tokenizer") else [])
    assert plan.coverage.complete and plan.coverage.bytes["stranded"] == 0
    assert plan.summary() == snapshot


def test_resolve_is_pure_and_deterministic():
    model = tiny_qwen2()
    types = [type(m) for m in model.modules()]
    first = streamwise.resolve(streamwise.load_policy("decoder-llm"), model)
    assert streamwise.resolve(streamwise.load_policy("decoder-llm"), model) == first
    assert [type(m) for m in model.modules()] == types


def test_plan_names_the_deciding_rule_and_compile_units():
    plan = streamwise.resolve(streamwise.load_policy("decoder-llm"), tiny_qwen2())
    q = plan.module("model.layers.0.self_attn.q_proj")
    assert (q.stream, q.stream_rule, q.class_name) == ("linear", "linear", "torch.nn.modules.linear.Linear")
    assert plan.module("model.rotary_emb").relocate == ("inv_freq", "original_inv_freq")
    assert [m.path for m in plan.modules if m.compile_unit] == ["model.layers.0", "model.layers.1"]


def test_unmatched_rule_is_a_located_error_with_a_suggestion(tmp_path):
    path = write_policy(
        tmp_path, "typo",
        '\n[[stream.rule]]\nid = "norms"\nkind = "llama_rms_norm"\nselect = { class = "Qwen2RMSNorn" }\n',
    )
    plan = streamwise.resolve(streamwise.load_policy(path), tiny_qwen2())
    (problem, stranded) = plan.diagnostics
    assert (problem.code, problem.suggestion, problem.location.line) == ("unmatched-rule", "Qwen2RMSNorm", 9)
    assert "rule `norms` in [stream] matches no module of `Qwen2ForCausalLM`" in problem.message
    assert stranded.code == "stranded-tensors" and stranded.severity == "warning"
    assert not plan.ok


def test_a_rule_that_selects_modules_but_never_decides_one_is_not_unmatched():
    policy = make_policy(stream={"rule": [
        stream_rule("linear", "linear", **{"class": "Linear"}),
        stream_rule("every-proj", "linear", regex=r".*proj"),  # beaten by nothing, ties with `q-proj`
        stream_rule("q-proj", "linear", regex=r".*q_proj"),
        stream_rule("heads", "linear", path=["lm_head"]),  # beats `linear` on its one module
    ]})
    plan = streamwise.resolve(policy, tiny_qwen2())
    assert [d.code for d in plan.diagnostics if d.is_error] == []
    assert plan.summary()["rule_matches"]["stream.linear"] == 0  # it selects every Linear, and decides none


def test_a_rule_whose_modules_are_all_excluded_is_not_unmatched():
    policy = make_policy(stream={
        "rule": [
            stream_rule("linear", "linear", **{"class": "Linear"}), stream_rule("head", "linear", path=["lm_head"]),
        ],
        "exclude": {"path": ["lm_head"]},
    })
    assert all(d.code != "unmatched-rule" for d in streamwise.resolve(policy, tiny_qwen2()).diagnostics)


def test_optional_rules_may_match_nothing():
    policy = make_policy(stream={"rule": [
        stream_rule("linear", "linear", **{"class": "Linear"}),
        {**stream_rule("ghost", "linear", **{"class": "GhostLinear"}), "optional": True},
    ]})
    assert all(d.code != "unmatched-rule" for d in streamwise.resolve(policy, tiny_qwen2()).diagnostics)


def test_equally_specific_rules_that_disagree_are_reported_with_both_places(tmp_path):
    path = write_policy(tmp_path, "tie", """
[[stream.rule]]
id = "by-projection"
kind = "linear"
select = { path = "model.layers.*.mlp.down_proj" }

[[stream.rule]]
id = "by-layer"
kind = "embedding"
select = { path = "model.layers.0.mlp.*" }
""")
    plan = streamwise.resolve(streamwise.load_policy(path), tiny_qwen2())
    conflicts = [d for d in plan.diagnostics if d.code == "rule-conflict"]
    assert len(conflicts) == 1
    text = render_text(conflicts)
    assert "rules `by-projection` and `by-layer` in [stream] select `model.layers.0.mlp.down_proj`" in text
    assert "tie.toml:14:1" in text and "tie.toml:9:1" in text


def test_a_more_specific_rule_wins():
    policy = make_policy(stream={"rule": [
        stream_rule("linear", "linear", **{"class": "Linear"}),
        stream_rule("head", "generic", path="lm_head"),  # another kind, to show who decides
    ]})
    plan = streamwise.resolve(policy, tiny_qwen2())
    assert plan.module("lm_head").stream_rule == "head"
    assert plan.module("model.layers.0.mlp.up_proj").stream_rule == "linear"


def test_streaming_a_container_is_an_error():
    policy = make_policy(stream={"rule": [stream_rule("mlp", "linear", **{"class": "Qwen2MLP"})]})
    (problem, *_) = streamwise.resolve(policy, tiny_qwen2()).diagnostics
    assert problem.code == "stream-container" and "model.layers.0.mlp" in problem.message


def test_a_module_cannot_both_stream_and_relocate():
    policy = make_policy(
        stream={"rule": [stream_rule("linear", "linear", **{"class": "Linear"})]},
        relocate={"rule": [{"id": "head", "select": {"path": "lm_head"}}]},
    )
    problems = [d for d in streamwise.resolve(policy, tiny_qwen2()).diagnostics if d.code == "rule-conflict"]
    assert len(problems) == 1 and (
        "Linear would both stream (rule `linear`) and relocate (rule `head`) (module: `lm_head`)" in problems[0].message
    )


def test_exclusions_and_gaps_show_up_as_stranded_tensors():
    policy = make_policy(
        stream={"exclude": {"path": "lm_head"}, "rule": [stream_rule("linear", "linear", **{"class": "Linear"})]},
    )
    plan = streamwise.resolve(policy, tiny_qwen2())
    stranded = {t.name for t in plan.coverage.stranded}
    assert "lm_head.weight" in stranded and "model.rotary_emb.inv_freq" in stranded and "model.norm.weight" in stranded
    assert plan.module("lm_head") is None
    assert 0 < plan.coverage.fraction < 1
    assert plan.ok  # stranded tensors are a warning: the user may know better


def test_tied_parameters_are_counted_once_and_reported():
    plan = streamwise.resolve(streamwise.load_policy("decoder-llm"), tiny_qwen2(tie_word_embeddings=True))
    assert plan.coverage.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    untied = streamwise.resolve(streamwise.load_policy("decoder-llm"), tiny_qwen2())
    assert untied.coverage.bytes["streamed"] - plan.coverage.bytes["streamed"] == 128 * 64 * 4


def test_a_streamed_leafs_extra_parameters_are_stranded():
    class ScaledLinear(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.scale = torch.nn.Parameter(torch.ones(4))

    policy = make_policy(stream={"rule": [stream_rule("l", "linear", **{"class": "ScaledLinear"})]})
    plan = streamwise.resolve(policy, torch.nn.Sequential(ScaledLinear()))
    assert [t.name for t in plan.coverage.stranded] == ["0.scale"]  # a fetch moves weight and bias only


def test_a_problem_repeated_in_every_layer_is_one_diagnostic_with_a_count():
    rule = {"id": "q", "select": {"class": ["Linear", "Embedding"]}, "format": "int8"}
    plan = streamwise.resolve(make_policy(quant={"rule": [rule]}), tiny_qwen2(num_hidden_layers=3))
    (problem,) = [d for d in plan.diagnostics if d.code == "quant-unsupported"]
    assert problem.message == ("quant rule `q`: `int8` applies to Linear layers, not to Embedding "
                               "(module: `model.embed_tokens`)")
    container = make_policy(stream={"rule": [stream_rule("mlp", "linear", **{"class": "Qwen2MLP"})]})
    (problem,) = [d for d in streamwise.resolve(container, tiny_qwen2(num_hidden_layers=3)).diagnostics
                  if d.code == "stream-container"]
    assert problem.message.endswith("(3 modules: `model.layers.0.mlp`, `model.layers.1.mlp`, `model.layers.2.mlp`)")


def test_a_plan_prints_as_the_cli_prints_it():
    plan = streamwise.resolve(streamwise.load_policy("decoder-llm"), tiny_qwen2())
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == f"plan: policy `decoder-llm` on {plan.root_class}"
    streamed = plan.summary()["modules"]["stream:linear"]
    assert f"  {'stream:linear':<24} {sum(streamed.values()):>6}  Linear x{streamed['Linear']}" in lines
    assert any(line.split() == ["streamed", *human(plan.coverage.bytes["streamed"]).split()] for line in lines)
    assert f"  {'covered':<24} {plan.coverage.percent:>12}" in lines


def test_plan_entries_are_built_in_the_order_of_module_plans_fields():
    """resolve builds each entry positionally from a template: the layout it assumes is ModulePlan's own, and an
    entry read by name says what was decided for that module."""
    import importlib

    from streamwise.runtime.plan.plan import ModulePlan

    resolving = importlib.import_module("streamwise.runtime.plan.resolve")  # the module, not the function

    assert resolving.ENTRY_LAYOUT == ModulePlan._fields
    plan = streamwise.resolve(streamwise.load_policy("decoder-llm"), tiny_qwen2())
    entry = next(e for e in plan.modules if e.path == "model.layers.0.mlp.down_proj")
    assert entry._asdict() == dict(
        path="model.layers.0.mlp.down_proj", class_name="torch.nn.modules.linear.Linear", stream="linear",
        stream_rule=entry.stream_rule, relocate=(), relocate_rule=None, quant=entry.quant, quant_rule=entry.quant_rule,
        group_size=entry.group_size, gguf_type=entry.gguf_type, compile_unit=False, kind_reason=entry.kind_reason)
    assert isinstance(entry.stream_rule, str) and entry.compile_unit is False
    block = next(e for e in plan.modules if e.path == "model.layers.0")
    assert block.compile_unit is True and block.class_name.endswith("Qwen2DecoderLayer")
