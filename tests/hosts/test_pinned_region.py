"""The host tier of a streamed placing is packed into pieces, a unit's tensors together in one (one copy per unit),
each piece filled before the next is made, so placing never holds the host tier twice; pinned pieces are powers of two
(torch's pinned allocator rounds each allocation up to one). No GPU here: a piece is a plain buffer, the carving, the
order of allocations and the undo are real."""

from __future__ import annotations

import copy
import itertools
import logging
import weakref

import pytest
import torch
from recording_device import RecordingOps

import streamwise
from streamwise.runtime.convert import applied_state
from streamwise.runtime.engine.journal import Journal
from streamwise.runtime.engine.stream import arena
from streamwise.runtime.hosts import standalone
from streamwise.runtime.hosts.standalone import OffloadReport

from helpers import tiny_qwen2


@pytest.fixture
def pieces(monkeypatch):
    made = []

    def region(nbytes, pinned):
        made.append((pinned, torch.zeros(nbytes, dtype=torch.uint8)))
        return made[-1][1]

    monkeypatch.setattr(arena, "host_region", region)
    return made


def _converted(**config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_qwen2(**config)
    streamwise.apply_policy(model, "decoder-llm")
    return model


def _layer_groups(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """Each decoder layer's streamed leaves as a group (a unit), then the rest one by one."""
    streamed = [m for m in model.modules() if m.__dict__.get("_sw_tree") is not None and m._parameters]
    layers = [[m for m in layer.modules() if any(m is s for s in streamed)] for layer in model.model.layers]
    grouped = {id(m) for layer in layers for m in layer}
    return layers + [[m] for m in streamed if id(m) not in grouped]


def _tensors(group: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p for m in group for p in m._parameters.values() if p is not None]


def _bytes(group: list[torch.nn.Module]) -> int:
    return sum(arena.padded(t.nbytes) for t in _tensors(group))


def test_pinned_pieces_are_powers_of_two_holding_whole_units_and_a_failure_gives_each_tensor_its_own(pieces,
                                                                                                    monkeypatch):
    model = _converted(num_hidden_layers=12, tie_word_embeddings=True)
    groups = _layer_groups(model)
    largest = max(_bytes(group) for group in groups)
    monkeypatch.setattr(arena, "PIECE", 2 * largest)  # a piece smaller than four units: four of them decide
    before = {id(p): (p, p.detach().clone(), p.data_ptr()) for group in groups for p in _tensors(group)}
    journal = Journal()
    with pytest.raises(KeyboardInterrupt), journal.atomic(lambda exc: None):
        pinned = arena.pack(journal, groups, pinned=True)
        sizes = [piece.numel() for _, piece in pieces]
        assert len(pieces) > 1 and all(p for p, _ in pieces) and pinned == sum(sizes)
        assert all(size & (size - 1) == 0 and size < 8 * largest for size in sizes)
        total = sum(arena.padded(t.nbytes) for t, _, _ in before.values())
        assert sum(sizes[:-1]) <= total  # the last piece rounds up, those before it are filled
        starts = {piece.data_ptr() for _, piece in pieces}
        for group in groups[:12]:  # each layer in one piece, its tensors one after another
            tensors = _tensors(group)
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
            assert tensors[0].untyped_storage().data_ptr() in starts
            assert all(b.data_ptr() == a.data_ptr() + arena.padded(a.nbytes) for a, b in itertools.pairwise(tensors))
        for parameter, values, _ in before.values():  # the same objects, now views of a piece, same values
            assert torch.equal(parameter, values)
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one view
        raise KeyboardInterrupt  # a failure later in the placing
    regions = {piece.untyped_storage().data_ptr() for _, piece in pieces}
    for parameter, values, _ in before.values():  # a copy of its own again, never a piece
        assert parameter.untyped_storage().data_ptr() not in regions and torch.equal(parameter, values)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_placing_holds_at_most_one_piece_beyond_the_host_tier(pieces, monkeypatch):
    """Each tensor's own memory is freed (its numpy array collected) once its view replaces it: when a piece is
    made, what the pieces before it hold is no longer held twice. Fails when the journal keeps the originals for its
    undo (`set_data` in place of `move_data`: tried) or one piece takes the whole host tier (tried)."""
    ops = RecordingOps()
    monkeypatch.setattr(standalone, "device_ops", lambda device: ops)
    model = _converted(num_hidden_layers=8)
    resident = copy.deepcopy(model)
    freed: set[int] = set()  # the parameters whose own memory is gone, by id
    for parameter in model.parameters():
        array = parameter.detach().numpy().copy()
        weakref.finalize(array, freed.add, id(parameter))
        parameter.data = torch.from_numpy(array)
    del array
    monkeypatch.setattr(arena, "PIECE", 2 * sum(arena.padded(p.nbytes) for p in model.model.layers[0].parameters()))
    twice = []  # at each piece made: the parameters packed into the pieces before it whose own memory is still held
    region = arena.host_region

    def counting(nbytes, pinned):
        ranges = [(piece.data_ptr(), piece.data_ptr() + piece.numel()) for _, piece in pieces]
        twice.append([id(p) for p in model.parameters() if id(p) not in freed
                      and any(start <= p.data_ptr() < end for start, end in ranges)])
        return region(nbytes, pinned)

    monkeypatch.setattr(arena, "host_region", counting)
    streamwise.offload(model, "decoder-llm", device="cpu", budget=0)
    assert len(twice) > 3 and not any(twice), twice
    packed = [p for p in model.parameters() if any(p.untyped_storage().data_ptr() == piece.data_ptr()
                                                    for _, piece in pieces)]
    assert len(packed) > 8 * 7 and all(id(p) in freed for p in packed)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)
    assert isinstance(applied_state(model).tree.fetcher, standalone.UnitStreamer)


def test_nothing_is_pinned_again_and_an_empty_host_tier_takes_no_piece(pieces, monkeypatch):
    model = _converted()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # all pinned already (an earlier placing)
    arena.pack(Journal(), [[m] for m in model.modules()], pinned=True)
    assert pieces == []


def test_a_host_tier_past_the_pinned_budget_stays_pageable_and_the_report_says_so(pieces, monkeypatch, caplog):
    monkeypatch.setattr(arena, "pinned_budget", lambda: 4096)  # less than the tiny model's host tier
    model = _converted()
    values = {id(p): p.detach().clone() for p in model.parameters()}
    with caplog.at_level(logging.WARNING, logger="streamwise.offload"):
        assert arena.pack(Journal(), [[m] for m in model.modules()], pinned=True) == 0
    assert pieces and not any(pinned for pinned, _ in pieces)
    assert "stay pageable" in caplog.text and "budget of 4.0 KiB" in caplog.text
    assert all(torch.equal(p, values[id(p)]) for p in model.parameters())  # packed all the same, values kept
    report = OffloadReport("cuda:0", "cpu", 0, 3, 0, 10_000)
    assert "the host tier is pageable (past the pinned budget)" in str(report)
    assert "pageable" not in str(OffloadReport("cuda:0", "cpu", 0, 3, 0, 10_000, pinned_bytes=10_000))
