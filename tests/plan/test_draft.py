"""`streamwise policy draft`: the drafted policy validates, resolves stranding nothing, and streams bit-identically."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import streamwise
from streamwise.runtime.cli.streamwise import main
from streamwise.runtime.plan.draft import draft_policy, policy_name
from streamwise.runtime.policy.load import check_policy

from helpers import tiny_qwen2

QWEN_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128)  # what `tiny_qwen2` builds


def tiny(class_name: str, **config) -> nn.Module:
    import transformers

    cls = getattr(transformers, class_name)
    return cls(cls.config_class(**config)).eval()


class ScaleNorm(nn.Module):
    """A norm no kind is made for: RMS statistics, a learned scale, and a buffer of its own."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.register_buffer("offset", torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight + self.offset


class Block(nn.Module):
    """A container holding a layer-scale parameter beside its parameter-holding children."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ScaleNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        return x + self.gamma * self.proj(self.norm(x))


class Positions(nn.Module):
    """Holds only a buffer: it relocates."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(16, dim))

    def forward(self, x):
        return x + self.table[: x.shape[1]]


class Toy(nn.Module):
    def __init__(self, dim: int = 8, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.positions = Positions(dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.final_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.positions(self.embed(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


class Linear(nn.Module):
    """Named like torch's Linear, told apart by its qualified name."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        return x @ self.weight


def toy_with_a_second_linear(local: bool) -> nn.Module:
    """Two classes named `Linear`: this module's (a qualified name tells them apart), or a local one (whose
    qualified name is no class entry, so one rule serves both)."""

    class Linear(nn.Module):  # the same name as the module-level class, on purpose
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(dim, dim))

        def forward(self, x):
            return x @ self.weight

    model = Toy()
    model.blocks[0].proj = Linear(8) if local else globals()["Linear"](8)
    return model


MODELS = {
    "qwen2": lambda: tiny_qwen2(),
    "gpt2": lambda: tiny("GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=64,
                         bos_token_id=0, eos_token_id=0),
    "gemma": lambda: tiny("GemmaForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64),
    "mamba": lambda: tiny("MambaForCausalLM", hidden_size=32, state_size=4, num_hidden_layers=2, vocab_size=64,
                          time_step_rank=4),
    "toy": Toy,
    "toy-named-alike": lambda: toy_with_a_second_linear(local=False),
    "toy-named-alike-locally": lambda: toy_with_a_second_linear(local=True),
}


def outputs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def drafted(tmp_path, model: nn.Module, name: str) -> streamwise.Policy:
    path = tmp_path / f"{name}.toml"
    path.write_text(draft_policy(model, name=name), encoding="utf-8")
    policy, diagnostics = check_policy(path)
    assert policy is not None and diagnostics == [], [str(d) for d in diagnostics]
    return policy


@pytest.mark.parametrize("which", MODELS)
def test_the_draft_validates_strands_nothing_and_streams_identically(tmp_path, which):
    torch.manual_seed(0)
    original = MODELS[which]().eval()
    policy = drafted(tmp_path, original, which)
    plan = streamwise.resolve(policy, original)
    assert plan.ok, [str(d) for d in plan.diagnostics]
    assert plan.diagnostics == ()  # not even a warning
    assert plan.coverage.bytes["stranded"] == 0 and plan.coverage.stranded == ()
    # the class rules cover the model by themselves: the catch-alls are only for other configs
    assert plan.rule_matches["stream.other-parameters"] == plan.rule_matches["relocate.other-buffers"] == 0

    ids = torch.randint(0, 32, (2, 5))
    expected = outputs(original, ids)
    model = copy.deepcopy(original)
    report = streamwise.offload(model, policy, device="cpu", budget=0)
    assert report.resident_modules == 0 and report.streamed_bytes > 0
    assert torch.equal(outputs(model, ids), expected)


def rule_kinds(policy: streamwise.Policy) -> dict[str, str]:
    """The kind each class entry of the stream rules names (the catch-all, which names no class, left out)."""
    return {entry: rule.kind for rule in policy.stream.rule for entry in rule.select.class_}


def test_kinds_are_proven_where_they_apply_and_generic_elsewhere(tmp_path):
    assert rule_kinds(drafted(tmp_path, MODELS["gemma"](), "gemma")) == {
        "Linear": "linear", "GemmaTextScaledWordEmbedding": "generic", "GemmaRMSNorm": "generic"}  # both override
    assert rule_kinds(drafted(tmp_path, MODELS["gpt2"](), "gpt2")) == {
        "Embedding": "embedding", "LayerNorm": "layer_norm", "Linear": "linear", "Conv1D": "generic"}
    policy = drafted(tmp_path, Toy(), "toy")
    assert rule_kinds(policy) == {  # the container holding `gamma`, the custom norm: their own forwards
        "Embedding": "embedding", "LayerNorm": "layer_norm", "Linear": "linear", "Block": "generic",
        "ScaleNorm": "generic"}
    assert [rule.select.class_ for rule in policy.relocate.rule if rule.select.class_] == [("Positions",)]
    assert streamwise.resolve(policy, Toy()).module("positions").relocate == ("table",)
    # classes named alike are told apart by their qualified names, or share one generic rule
    assert rule_kinds(drafted(tmp_path, MODELS["toy-named-alike"](), "alike"))[
        f"{__name__}.Linear"] == "generic"
    assert rule_kinds(drafted(tmp_path, MODELS["toy-named-alike-locally"](), "local"))["Linear"] == "generic"


def test_the_draft_names_the_model_and_its_blocks(tmp_path):
    text = draft_policy(MODELS["mamba"](), name="mamba")
    assert text.startswith("#:schema ../schemas/policy.v1.schema.json\n")
    policy = drafted(tmp_path, MODELS["mamba"](), "mamba")
    assert policy.match.classes == ("MambaForCausalLM",) and policy.match.model_types == ("mamba",)
    assert policy.compile.enabled is False
    assert policy.compile.blocks.class_ == ("MambaBlock", "MambaMixer")
    assert "# MambaMixer" not in text and '"MambaMixer",  # 2 modules' in text  # a reason per class
    assert drafted(tmp_path, Toy(), "toy").compile.blocks is None  # declares none


def test_the_commented_quant_example_is_valid_once_uncommented(tmp_path):
    model = tiny_qwen2()
    lines = draft_policy(model, name="qwen").splitlines()
    start = lines.index("# [quant]")
    end = lines.index("", start)
    uncommented = [line.removeprefix("# ") if line != "#" else "" for line in lines[start:end]]
    path = tmp_path / "qwen.toml"
    path.write_text("\n".join(lines[:start] + uncommented + lines[end:]), encoding="utf-8")
    policy = streamwise.load_policy(path)
    assert [rule.format for rule in policy.quant.rule] == ["int8"]
    assert policy.quant.exclude.path == ("lm_head",)
    small = policy.model_copy(update={"quant": policy.quant.model_copy(update={"rule": (
        policy.quant.rule[0].model_copy(update={"min_weights": 0}),)})})
    plan = streamwise.resolve(small, model)
    assert plan.ok and plan.coverage.bytes["stranded"] == 0
    quantized = {entry.path for entry in plan.modules if entry.quant}
    assert "model.layers.0.mlp.up_proj" in quantized and "lm_head" not in quantized


def test_policy_names_come_from_the_root_class():
    assert policy_name("Qwen2ForCausalLM") == "qwen2-for-causal-lm"
    assert policy_name("GPT2LMHeadModel") == "gpt2-lm-head-model"
    assert policy_name("Toy") == "toy"


def test_the_command_writes_the_draft_of_a_meta_model(tmp_path, capsys):
    path = tmp_path / "qwen-tiny.toml"
    argv = ["policy", "draft", "--model", "transformers:Qwen2ForCausalLM", "--model-config", json.dumps(QWEN_CONFIG),
            "-o", str(path)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(path)
    model = tiny_qwen2()
    text = path.read_text(encoding="utf-8")
    assert text == draft_policy(model, name="qwen-tiny", spec="transformers:Qwen2ForCausalLM")  # meta = real
    plan = streamwise.resolve(streamwise.load_policy(path), model)
    assert plan.ok and plan.coverage.bytes["stranded"] == 0
    assert main(argv) == 1 and "exists; pass --force" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0


def test_the_command_prints_the_draft_without_a_file(capsys):
    argv = ["policy", "draft", "--model", "transformers:qwen2", "--model-config", json.dumps(QWEN_CONFIG)]
    assert main([*argv, "--name", "q"]) == 0
    assert 'name = "q"' in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    (["--model", "transformers:NoSuchModelForCausalLM"], "transformers has no model class or model_type"),
    (["--model", "transformers:qwen2", "--model-config", "{hidden_size: 8}"], "--model-config is not JSON"),
    (["--model", "transformers:qwen2", "-o", "x.toml", "--name", "y"], "differs from the file name"),
])
def test_bad_input_is_a_message_and_exit_status_1(capsys, extra, message):
    assert main(["policy", "draft", *extra]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and captured.out == ""
