"""Placing by measured costs (`engine.stream.placement`, `offload(..., measure=...)`): the streamed blocks spread along
the compute a measuring forward timed, so each copy has compute before it to hide behind; unmeasured, along their
bytes, as before. The measuring forward runs through the recording fake device, its clock a fake one."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from recording_device import RecordingOps
from torch import nn

import streamwise
from streamwise.runtime.convert import applied_state
from streamwise.runtime.engine.stream import measure
from streamwise.runtime.engine.stream.placement import spread
from streamwise.runtime.engine.stream.streamer import UnitStreamer
from streamwise.runtime.hosts import standalone

from helpers import tiny_qwen2


def _waits(streamed: list[bool], compute: list[float], copy_seconds: float) -> float:
    """Seconds the device waits for copies in a forward: each streamed block's copy is issued as the streamed block
    before it is entered (around the forward's end for the first) and hides behind the compute between."""
    indices = [i for i, s in enumerate(streamed) if s]
    waited = 0.0
    for before, block in zip(indices[-1:] + indices[:-1], indices, strict=True):
        window = sum(compute[before:block]) if block > before else sum(compute[before:]) + sum(compute[:block])
        waited += max(0.0, copy_seconds - window)
    return waited


@pytest.mark.parametrize(("compute", "copy_seconds"), [
    ([4.0] * 4 + [1.0] * 4, 4.0),  # a heavier first half (another quantization, a longer sequence)
    ([10.0] * 4 + [1.0] * 8, 5.0),  # a vision tower over hundreds of patches before a language model's layers
])
def test_measured_compute_puts_the_copies_where_the_compute_hides_them(compute, copy_seconds):
    """Blocks of equal bytes, half of them to stream: spread along their bytes, some copies outlast the compute before
    them; spread along the measured compute, the device waits less (the copies fit within the compute overall)."""
    names, sizes = [f"layers.{i}" for i in range(len(compute))], [100] * len(compute)
    budget = 100 * (len(compute) - 4)
    by_bytes = [not kept for kept in spread(names, sizes, budget)]
    measured = [not kept for kept in spread(names, sizes, budget, dict(zip(names, compute, strict=True)))]
    assert sum(by_bytes) == sum(measured) == 4
    assert _waits(measured, compute, copy_seconds) < _waits(by_bytes, compute, copy_seconds)
    assert sum(measured[:4]) > sum(by_bytes[:4])  # more of the copies behind the heavy blocks


@pytest.mark.parametrize(("budget", "kept"), [
    (0, "........"), (400, "#.#.#.#."), (600, "##.###.#"), (700, "####.###"), (800, "########")])
def test_unmeasured_blocks_are_spread_along_their_bytes(budget, kept):
    """Eight blocks alike: one streamed block in every `total / (total - budget)`, none two in a row."""
    names = [f"layers.{i}" for i in range(8)]
    assert "".join("#" if k else "." for k in spread(names, [100] * 8, budget)) == kept


class _Clock:
    """A fake clock each decoder layer advances by its cost as it computes: the measured compute, made exact."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> float:
        return self.seconds


@pytest.fixture
def ops(monkeypatch):
    recording = RecordingOps()
    monkeypatch.setattr(standalone, "device_ops", lambda device: recording)
    return recording


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(standalone, "UnitClock", lambda ops: measure.UnitClock(ops, now=fake.now))
    return fake


def _costly(model: nn.Module, clock: _Clock, costs: list[float]) -> None:
    for layer, cost in zip(model.model.layers, costs, strict=True):
        layer.register_forward_hook(lambda m, a, o, cost=cost: setattr(clock, "seconds", clock.seconds + cost))


def _streamed_layers(model: nn.Module) -> list[int]:
    streamer = applied_state(model).tree.fetcher
    return [int(unit.name.rsplit(".", 1)[1]) for unit in streamer.units if unit.name.startswith("model.layers.")]


def test_offload_spreads_the_streamed_layers_along_a_measuring_forward(ops, clock, caplog):
    """The measuring forward streams every unit, one at a time, synchronising at each; its per-unit compute places
    the streamed layers behind the heavy ones; the model computes what it computes resident, and a settled forward
    synchronises nothing. Fails with the measured compute ignored (bytes: as many streamed in either half; tried)."""
    torch.manual_seed(0)
    resident = tiny_qwen2(num_hidden_layers=8)
    streamwise.apply_policy(resident, "decoder-llm")
    budget = int(sum(p.nbytes for p in resident.parameters()) * 0.6)
    ids = torch.randint(0, 128, (1, 6))
    costs = [4.0] * 4 + [1.0] * 4

    by_bytes = copy.deepcopy(resident)
    streamwise.offload(by_bytes, "decoder-llm", device="cpu", budget=budget)
    model = copy.deepcopy(resident)
    _costly(model, clock, costs)
    with caplog.at_level(logging.INFO, logger="streamwise.offload"):
        report = streamwise.offload(model, "decoder-llm", device="cpu", budget=budget,
                                    measure=lambda m: m(ids))

    measured = dict(report.measured)
    assert [measured[f"model.layers.{i}"] for i in range(8)] == costs
    assert "the measuring forward computed" in caplog.text
    assert "spread along the compute of one measuring forward (11 blocks" in str(report)
    assert ("synchronize",) in ops.log  # the measuring forward's, while placing
    layers, even = _streamed_layers(model), _streamed_layers(by_bytes)
    assert sum(i < 4 for i in layers) > sum(i >= 4 for i in layers), layers
    assert sum(i < 4 for i in even) <= sum(i >= 4 for i in even), even
    streamer = applied_state(model).tree.fetcher
    assert isinstance(streamer, UnitStreamer) and len(streamer.slots) == UnitStreamer.SLOTS
    assert report.resident_bytes + sum(slot.buffer.nbytes for slot in streamer.slots) <= budget
    settled = len(ops.log)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)
    assert ("synchronize",) not in ops.log[settled:]


def test_a_model_partly_in_its_file_is_measured_block_by_block(ops, clock, tmp_path):
    """A block with leaves on the file tier streams a unit per leaf: their times add up to the block's, which is what
    the spread reads (fails with the leaves' own names kept: every layer then counts as computing nothing)."""
    torch.manual_seed(0)
    tiny_qwen2(num_hidden_layers=4, tie_word_embeddings=False).save_pretrained(tmp_path)
    model = streamwise.load_pretrained(tmp_path, "auto", progress=False, max_memory={"cpu": 96 << 10}).model
    _costly(model, clock, [2.0, 1.0, 1.0, 1.0])
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=1 << 10,
                                measure=lambda m: m(torch.randint(0, 128, (1, 5))))
    assert report.file_bytes > 0
    measured = dict(report.measured)
    assert [measured[f"model.layers.{i}"] for i in range(4)] == [2.0, 1.0, 1.0, 1.0]


def test_a_measuring_forward_that_fails_leaves_the_tree_as_it_was(ops, clock):
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=4)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    classes = {name: type(module) for name, module in model.named_modules()}

    def fails(m):
        m(torch.randint(0, 128, (1, 4)))
        raise RuntimeError("out of memory in the measuring forward")

    with pytest.raises(standalone.OffloadError, match="restored unchanged"):
        streamwise.offload(model, "decoder-llm", device="cpu", budget=1 << 10, measure=fails)
    assert applied_state(model) is None
    assert {name: type(module) for name, module in model.named_modules()} == classes
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_measure_is_not_run_where_nothing_is_to_be_spread(ops, clock, caplog):
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=2)
    calls = []
    with caplog.at_level(logging.WARNING, logger="streamwise.offload"):
        report = streamwise.offload(model, "decoder-llm", device="cpu", budget=None, measure=calls.append)
    assert not calls and not report.measured
    assert "`measure` is not run: the budget holds every streamed leaf" in caplog.text


def test_a_model_armed_for_compile_is_measured_once_its_graphs_are_compiled(ops, clock):
    """The first forward of an armed model compiles its blocks' graphs: placing runs `measure` once untimed, then
    times the second (fails when the first is timed: the compile would count as the first block's compute)."""
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=4)
    streamwise.lazy_compile(model, "decoder-llm", backend="aot_eager")
    _costly(model, clock, [3.0, 1.0, 1.0, 1.0])
    ids, calls = torch.randint(0, 128, (1, 5)), []

    def measured(m):
        calls.append(clock.seconds)
        m(ids)

    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=0, measure=measured)
    assert len(calls) == 2
    assert [dict(report.measured)[f"model.layers.{i}"] for i in range(4)] == [3.0, 1.0, 1.0, 1.0]
