"""The probe holds a class named exactly with a specific kind to that kind: every configuration, every input rank,
two magnitudes, a few ulp in float32. Each case is a difference a looser probe would let through."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwise
from streamwise.runtime.convert import ConversionError, applied_state
from streamwise.runtime.engine.kinds import COMPUTE_KINDS
from streamwise.runtime.engine.probe import ULPS, probe

from helpers import ChannelsFirstLayerNorm, ChannelsFirstRMSNorm, make_policy, stream_rule, tiny_qwen2
from look_alikes import make, swap_in


def _named(name: str, kind: str, base: str, perturbation: str, rank: int = 3) -> tuple[nn.Module, object]:
    """A tiny Qwen2 whose `name` modules are look-alikes, and a policy naming them exactly with `kind`."""
    torch.manual_seed(0)
    model = tiny_qwen2()
    swap_in(model, make(name, base, perturbation, rank), base, perturbation)
    rules = [stream_rule("named", kind, **{"class": f"look_alike_models.{name}"}),
             stream_rule("rest", "auto", holds="parameters")]
    return model, make_policy(stream={"rule": rules})


class Nudged(nn.Linear):
    """`nn.Linear` off by a relative 3e-6: under a 1e-5 tolerance it would pass as `linear`."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * (1 + 3e-6)


def test_a_difference_of_a_few_millionths_is_caught():
    problem = probe(COMPUTE_KINDS["linear"], Nudged(16, 8))
    assert problem is not None and re.search(r"differs from the class's own forward by (2\.9|3\.0)\d*e-06", problem)
    assert ULPS * torch.finfo(torch.float32).eps < 3e-6 / 4  # the allowance is well inside what it catches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_math_under_another_class_passes_in_every_dtype(dtype):
    model, policy = _named("Linear", "linear", "linear", "plain")
    model.to(dtype)
    streamwise.apply_policy(model, policy)  # no ConversionError: the probe found the kind computes the class
    assert applied_state(model) is not None


def test_a_term_for_three_dimensional_inputs_only_is_caught():
    """A probe on (2, features) alone would pass it."""
    model, policy = _named("Linear", "linear", "linear", "rank-term", rank=3)
    with pytest.raises(ConversionError, match=r"differs from the class's own forward by .*input shape \(2, 3, 64\)"):
        streamwise.apply_policy(model, policy)
    assert applied_state(model) is None


def test_a_per_instance_parameter_that_is_neutral_on_the_first_module_only_is_caught():
    """A probe of the first module of the class alone would pass it: each configuration is probed."""
    model, policy = _named("Qwen2RMSNorm", "llama_rms_norm", "rms_norm", "instance-scale")
    first = next(m for m in model.modules() if type(m).__name__ == "Qwen2RMSNorm")
    assert first.scale.item() == 1.0
    with pytest.raises(ConversionError, match=r"computes `model\.layers\.0\.post_attention_layernorm` "):
        streamwise.apply_policy(model, policy)


def test_eps_outside_the_square_root_is_caught():
    model, policy = _named("Qwen2RMSNorm", "llama_rms_norm", "rms_norm", "eps-outside")
    with pytest.raises(ConversionError, match=r"differs from the class's own forward by 1\.\d+e-06"):
        streamwise.apply_policy(model, policy)


class ClampedRMSNorm(nn.Module):
    """LlamaRMSNorm with the variance clamped at eps instead of eps added: at unit scale the two differ by a few
    parts in 10^7, where activations are as small as sqrt(eps) by far more."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True).clamp_min(self.variance_epsilon)
        return self.weight * (x * torch.rsqrt(variance))


def test_a_difference_that_shows_only_at_small_magnitudes_is_caught():
    problem = probe(COMPUTE_KINDS["llama_rms_norm"], ClampedRMSNorm(64))
    assert problem is not None and "at magnitude 0.001" in problem


def test_the_probe_leaves_the_tree_and_the_callers_random_state_alone():
    layer = Nudged(16, 8).to(torch.bfloat16)
    before = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    state = torch.random.get_rng_state()
    probe(COMPUTE_KINDS["linear"], layer)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert "weight" not in vars(layer) and layer.weight.dtype == torch.bfloat16  # the float32 shadows are gone
    assert all(torch.equal(before[name], tensor) for name, tensor in layer.state_dict().items())


# --- the tolerance and the comparison at their edges: a kind and a class whose outputs are set exactly ------------

class Fixed(nn.Linear):
    """A layer whose own forward gives `self.output` whatever the input (the probe compares outputs only)."""

    output: object = None

    def forward(self, x):
        return self.output


def edge_kind(compute) -> object:
    from streamwise.runtime.engine.kinds import ComputeKind

    return ComputeKind(name="edge", function=lambda module, x, weight, bias: compute(module), dtype="input",
                       requires=("weight",), probe=lambda module, generator: [torch.ones(2, 3)])


def fixed(output) -> Fixed:
    layer = Fixed(3, 4)
    layer.output = output
    return layer


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0 ** -20])
def test_four_ulp_of_the_largest_output_pass_and_five_are_refused(scale):
    """Relative to the largest output, in float32 epsilons: `ULPS` is 4, as docs/engine.md says."""
    expected = torch.full((2, 4), scale)
    eps = torch.finfo(torch.float32).eps

    def off_by(ulps):
        got = expected.clone()
        got[0, 0] = scale * (1 + ulps * eps)  # exact: a multiple of the ulp of a power of two
        return edge_kind(lambda module: got)

    assert ULPS == 4
    assert probe(off_by(4), fixed(expected)) is None
    assert "differs from the class's own forward by 5.96e-07" in probe(off_by(5), fixed(expected))


def test_an_all_zero_output_is_compared_absolutely():
    zeros = torch.zeros(2, 4)
    assert probe(edge_kind(lambda module: zeros.clone()), fixed(zeros)) is None
    eps = torch.finfo(torch.float32).eps
    assert "differs" in probe(edge_kind(lambda module: zeros + 5 * eps), fixed(zeros))


def test_an_integer_output_must_be_equal():
    counts = torch.tensor([[3, 5]])
    assert probe(edge_kind(lambda module: counts.clone()), fixed(counts)) is None
    assert "differs" in probe(edge_kind(lambda module: counts + 1), fixed(counts))


@pytest.mark.parametrize("gives, output, found", [
    ((2, 4), torch.zeros(2, 8), "(2, 8)"),
    ((2, 8), torch.zeros(2, 4), "(2, 4)"),
    ((2, 4), (torch.zeros(2, 4),), "tuple"),
], ids=["class-wider", "kind-wider", "class-tuple"])
def test_a_kind_whose_output_differs_in_shape_or_type_is_refused_saying_what_each_gives(gives, output, found):
    problem = probe(edge_kind(lambda module: torch.zeros(gives)), fixed(output))
    assert problem == f"`edge` gives shape {gives} where the class gives {found} (input shape (2, 3))"


def test_a_problem_at_magnitude_one_names_no_magnitude():
    problem = probe(edge_kind(lambda module: torch.ones(2, 4)), fixed(torch.zeros(2, 4) + 2))
    assert problem.endswith("(relative, input shape (2, 3); allowed 4.8e-07)")


def test_nothing_is_probed_on_meta_or_integer_weights():
    with torch.device("meta"):
        on_meta = Nudged(16, 8)
    integer = Nudged(16, 8)
    integer.weight = nn.Parameter(torch.ones(8, 16, dtype=torch.int32), requires_grad=False)
    assert probe(COMPUTE_KINDS["linear"], on_meta) is None and probe(COMPUTE_KINDS["linear"], integer) is None


def test_an_embedding_look_alike_is_probed_on_every_index_as_given():
    class Table(nn.Embedding):
        def forward(self, x):
            return F.embedding(x, self.weight, self.padding_idx)

    assert probe(COMPUTE_KINDS["embedding"], Table(10, 4)) is None


def test_a_flag_set_to_none_is_part_of_a_modules_configuration():
    from streamwise.runtime.engine.probe import configuration

    layer = nn.Linear(2, 2)
    layer.mode = None
    assert ("mode", None) in configuration(COMPUTE_KINDS["linear"], layer)[0]


def test_a_missing_bias_is_no_tensor_of_the_configuration():
    from streamwise.runtime.engine.probe import configuration

    names = [entry[0] for entry in configuration(COMPUTE_KINDS["linear"], nn.Linear(2, 2, bias=False))[1]]
    assert names == ["weight"]


def test_an_embedding_look_alike_that_differs_is_named_without_a_magnitude():
    class Shifted(nn.Embedding):
        def forward(self, x):
            return F.embedding(x, self.weight, self.padding_idx) + 1

    problem = probe(COMPUTE_KINDS["embedding"], Shifted(10, 4))
    assert problem.startswith("`embedding` differs from the class's own forward") and "magnitude" not in problem


# --- every input rank the probe feeds each kind: a difference at that rank alone is caught ------------------------

def _llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(6)


def _randomized(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter))
    return module


# kind -> (a module of a class it computes, its weight's dimensions all different; the input ranks probed)
RANKS = {
    "linear": (lambda: nn.Linear(16, 8), (1, 2, 3, 4)),
    "embedding": (lambda: nn.Embedding(3, 5), (1, 2, 3)),  # fewer rows than columns
    "conv1d": (lambda: nn.Conv1d(3, 5, 3), (2, 3)),
    "conv2d": (lambda: nn.Conv2d(3, 5, 3), (3, 4)),
    "conv3d": (lambda: nn.Conv3d(2, 4, 2), (4, 5)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(3, 5, 2, stride=2), (2, 3)),  # a kernel of neither width
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 5, 2, stride=2), (3, 4)),
    "layer_norm": (lambda: nn.LayerNorm(6), (1, 2, 3, 4)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (2, 3, 4)),
    "rms_norm": (lambda: nn.RMSNorm(6), (1, 2, 3, 4)),
    "llama_rms_norm": (_llama_rms_norm, (1, 2, 3, 4)),
    "conv_rms_norm": (lambda: ChannelsFirstRMSNorm(6), (3,)),
    "conv_layer_norm": (lambda: ChannelsFirstLayerNorm(6), (3,)),
}


def _look_alike(module: nn.Module, rank: int | None) -> nn.Module:
    """`module` under a class of its own computing the same, plus a quarter at input rank `rank` only."""
    base = type(module)

    def forward(self, x, *args, **kwargs):
        y = base.forward(self, x, *args, **kwargs)
        return y + 0.25 if x.dim() == rank else y

    module.__class__ = type(base.__name__, (base,), {"forward": forward})
    return module


@pytest.mark.parametrize("kind", sorted(RANKS))
def test_a_look_alike_that_computes_the_same_passes_at_every_rank(kind):
    build, _ = RANKS[kind]
    assert probe(COMPUTE_KINDS[kind], _look_alike(_randomized(build()), None)) is None


@pytest.mark.parametrize("kind, rank", [(kind, rank) for kind, (_, ranks) in sorted(RANKS.items()) for rank in ranks])
def test_a_difference_at_one_input_rank_alone_is_caught(kind, rank):
    build, _ = RANKS[kind]
    problem = probe(COMPUTE_KINDS[kind], _look_alike(_randomized(build()), rank))
    assert problem is not None and problem.startswith(f"`{kind}` differs from the class's own forward")
    shape = ", ".join([r"\d+"] * rank) + ("," if rank == 1 else "")
    assert re.search(rf"input shape \({shape}\)", problem), problem


def test_the_first_row_of_an_embedding_is_probed():
    """Index 0 (often the padding row) is drawn like any other."""

    class ZeroFirst(nn.Embedding):
        def forward(self, x):
            return F.embedding(x, self.weight) * (x != 0).unsqueeze(-1)

    assert "differs" in probe(COMPUTE_KINDS["embedding"], _randomized(ZeroFirst(2, 4)))


@pytest.mark.parametrize("build", [
    lambda: nn.Conv1d(2, 3, 3, dilation=12),
    lambda: nn.Conv2d(2, 3, (2, 5), dilation=(30, 1)),
    lambda: nn.Conv1d(2, 3, 21),
], ids=["dilated", "dilated-2d", "wide-kernel"])
def test_a_convolution_whose_reach_exceeds_a_short_input_is_probed_on_a_long_enough_one(build):
    """The probe's length follows what the kernel reaches (its size and dilation), or the class's own forward fails."""
    conv = build()
    kind = f"conv{conv.weight.dim() - 2}d"
    assert probe(COMPUTE_KINDS[kind], _look_alike(_randomized(conv), None)) is None
    assert "differs" in probe(COMPUTE_KINDS[kind], _look_alike(_randomized(build()), conv.weight.dim()))
