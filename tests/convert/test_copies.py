"""`unconverted_copy`: a tree to convert that leaves its source exactly as it was, over the same weights."""

from __future__ import annotations

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
