"""`unconverted_copy`: a tree to convert that leaves its source exactly as it was, over the same weights."""

from __future__ import annotations

import functools

import torch
from torch import nn

from streamwise.runtime.convert import applied_state, apply_policy, unconverted_copy
from streamwise.runtime.engine import protocol

from helpers import tiny_qwen2, write_policy


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 1, 4, 1, 5, 9]])).logits


def snapshot(model: nn.Module) -> list:
    """Everything a conversion or a move could change, by module: class, attribute names, tensors by identity."""
    return [(path, type(m), sorted(m.__dict__), [(n, id(t), t.device, t._version) for n, t in
                                                 [*m._parameters.items(), *m._buffers.items()] if t is not None])
            for path, m in model.named_modules(remove_duplicate=False)]


def test_a_copy_shares_the_weights_but_nothing_a_move_or_a_hook_changes():
    source = tiny_qwen2(tie_word_embeddings=True)
    expected, before = logits(source), snapshot(source)
    copy = unconverted_copy(source)
    pairs = list(zip(source.modules(), copy.modules(), strict=True))
    assert all(a is not b and type(a) is type(b) for a, b in pairs)
    for (name, p), (_, q) in zip(source.named_parameters(), copy.named_parameters(), strict=True):
        assert p is not q and p.data_ptr() == q.data_ptr(), name  # one copy of the weights in memory
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # a tie stays a tie
    copy.model.layers[0].register_forward_hook(lambda *args: None)
    copy.to("meta")
    assert snapshot(source) == before
    assert torch.equal(logits(source), expected)


def test_a_converted_source_is_copied_as_it_was_and_converts_under_another_policy():
    source = tiny_qwen2()
    expected = logits(source)
    apply_policy(source, "decoder-llm")
    before = snapshot(source)
    copy = unconverted_copy(source)
    assert applied_state(copy) is None and all(type(m) is protocol.original_class(type(m)) for m in copy.modules())
    apply_policy(copy, "any-module")
    assert applied_state(copy).plan.policy == "any-module" and applied_state(source).plan.policy == "decoder-llm"
    assert snapshot(source) == before
    assert torch.equal(logits(copy), expected) and torch.equal(logits(source), expected)


def test_quantized_residents_stay_residents_in_a_copy_and_compute_the_same(tmp_path):
    source = tiny_qwen2()
    apply_policy(source, write_policy(tmp_path, "int8", 'extends = "decoder-llm"\n\n[[quant.rule]]\nid = "q"\n'
                                                            'select = { class = "Linear" }\nformat = "int8"\n'))
    expected, before = logits(source), snapshot(source)
    copy = unconverted_copy(source)
    residents = [m for m in copy.modules() if protocol.is_resident(m)]
    assert residents and all(protocol.tree_of(m) is applied_state(copy).tree for m in residents)
    _, plan = apply_policy(copy, "any-module")  # a policy without a quant rule: the residents stream all they store
    assert plan.coverage.complete and plan.coverage.stranded == ()
    assert torch.equal(logits(copy), expected)
    assert snapshot(source) == before and torch.equal(logits(source), expected)


def test_a_forward_bound_to_a_module_runs_the_copy_not_its_source():
    """A hook library's per-instance forward (`functools.partial(new_forward, module)`, as accelerate's hooks, with
    the old bound forward kept beside it) is bound to the copy: the copy never computes with its source's tensors."""
    source = nn.Sequential(nn.Linear(4, 4))
    leaf = source[0]
    leaf._old_forward = leaf.forward

    def new_forward(module, x):
        return module._old_forward(x) * 2

    leaf.forward = functools.update_wrapper(functools.partial(new_forward, leaf), leaf._old_forward)
    x = torch.randn(2, 4)
    expected = source(x)
    copy = unconverted_copy(source)
    with torch.no_grad():
        copy[0].weight.data = torch.zeros(4, 4)  # a move swaps the copy's data; the source keeps its own
    assert torch.equal(copy(x), copy[0].bias.expand(2, 4) * 2)
    assert torch.equal(source(x), expected)


def test_a_copy_reads_the_file_through_its_own_tier_and_casts_apart(tmp_path):
    """A loaded tree's weights left in their file: the copy reads them through staging of its own, and a dtype cast
    of the copy (which rewrites the file-tier records it casts) leaves the source's records and numbers alone."""
    import streamwise
    from streamwise.runtime.engine import file_tier

    torch.manual_seed(0)
    tiny_qwen2().save_pretrained(tmp_path)
    source = streamwise.load_pretrained(tmp_path, "decoder-llm", progress=False, max_memory={"cpu": 160 << 10}).model
    expected = logits(source)
    copy = unconverted_copy(source)
    left = [(path, m) for path, m in source.named_modules() if file_tier.in_file(m)]
    assert left
    for path, module in left:
        theirs, ours = module.__dict__[protocol.SOURCES], copy.get_submodule(path).__dict__[protocol.SOURCES]
        assert ours.tier is applied_state(copy).tree.file_tier is not theirs.tier
    apply_policy(copy, "decoder-llm")
    copy.to(torch.bfloat16)
    assert all(source.dtype == torch.float32 for _, m in left for source in file_tier.sources(m).values())
    assert logits(copy).dtype == torch.bfloat16 and torch.equal(logits(source), expected)
