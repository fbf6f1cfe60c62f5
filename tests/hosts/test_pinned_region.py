"""The host tier of a CUDA placing is pinned as one region of exactly its bytes (torch's pinned allocator rounds
each allocation up to a power of two). No GPU here: the region is a plain buffer, the carving and undo are real."""

from __future__ import annotations

import logging

import pytest
import torch

import streamwise
from streamwise.runtime.engine.journal import Journal
from streamwise.runtime.engine.stream import arena
from streamwise.runtime.hosts.standalone import OffloadReport

from helpers import tiny_qwen2


@pytest.fixture
def regions(monkeypatch):
    made = []

    def region(nbytes, pinned):
        assert pinned
        made.append(torch.zeros(nbytes, dtype=torch.uint8))
        return made[-1]

    monkeypatch.setattr(arena, "host_region", region)
    return made


def test_the_host_tier_is_one_region_of_its_bytes_and_a_failure_gives_each_tensor_back(regions):
    torch.manual_seed(0)
    model = tiny_qwen2(tie_word_embeddings=True)
    streamwise.apply_policy(model, "decoder-llm")
    owners = [m for m in model.modules() if m.__dict__.get("_sw_tree") is not None and m._parameters]
    before = {id(p): (p, p.detach().clone(), p.data_ptr()) for m in owners for p in m._parameters.values()
              if p is not None}
    journal = Journal()
    with pytest.raises(KeyboardInterrupt), journal.atomic(lambda exc: None):
        arena.pack(journal, owners, pinned=True)
        (region,) = regions
        total = sum(t.numel() * t.element_size() for t, _, _ in before.values())
        assert total <= region.numel() <= total + arena.ALIGNMENT * len(before)  # exact, less alignment
        for parameter, values, _ in before.values():  # the same objects, now views of the region, same values
            assert parameter.untyped_storage().data_ptr() == region.data_ptr() and torch.equal(parameter, values)
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one view
        raise KeyboardInterrupt  # a failure later in the placing
    for parameter, values, pointer in before.values():
        assert parameter.data_ptr() == pointer and torch.equal(parameter, values)


def test_nothing_is_pinned_again_and_an_empty_host_tier_takes_no_region(regions, monkeypatch):
    model = tiny_qwen2()
    streamwise.apply_policy(model, "decoder-llm")
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # all pinned already (an earlier placing)
    arena.pack(Journal(), list(model.modules()), pinned=True)
    assert regions == []


def test_a_region_past_the_pinned_budget_stays_pageable_and_the_report_says_so(monkeypatch, caplog):
    asked = []

    def region(nbytes, pinned):
        asked.append(pinned)
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(arena, "host_region", region)
    monkeypatch.setattr(arena, "pinned_budget", lambda: 4096)  # less than the tiny model's host tier
    torch.manual_seed(0)
    model = tiny_qwen2()
    streamwise.apply_policy(model, "decoder-llm")
    values = {id(p): p.detach().clone() for p in model.parameters()}
    with caplog.at_level(logging.WARNING, logger="streamwise.offload"):
        assert arena.pack(Journal(), list(model.modules()), pinned=True) == 0
    assert asked == [False] and "stay pageable" in caplog.text and "budget of 4.0 KiB" in caplog.text
    assert all(torch.equal(p, values[id(p)]) for p in model.parameters())  # packed all the same, values kept
    report = OffloadReport("cuda:0", "cpu", 0, 3, 0, 10_000)
    assert "the host tier is pageable (past the pinned budget)" in str(report)
    assert "pageable" not in str(OffloadReport("cuda:0", "cpu", 0, 3, 0, 10_000, pinned_bytes=10_000))
