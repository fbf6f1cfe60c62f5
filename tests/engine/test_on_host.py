"""Computing a streamed block on the host (`engine.stream.on_host`), read from the recording fake device: decode
steps computed where the weights lie and prompts streamed, chosen from the costs; costs left out measured once; the
numbers those of the resident model; a KV cache followed across devices."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch
from recording_device import RecordingOps
from torch import nn

import streamwise
from streamwise.runtime.convert import applied_state
from streamwise.runtime.engine.stream import on_host
from streamwise.runtime.hosts import standalone
from streamwise.runtime.quant import numba_kernels

from helpers import tiny_qwen2
from llama_cpp_files import float_model, train_tokenizer_parts, write_llama_cpp_gguf

GREEDY = dict(max_new_tokens=5, do_sample=False)
DECODE_ON_HOST = dict(link=1e-9, host={rows: 1e-10 if rows <= 4 else 1e-8 for rows in (1, 2, 4, 8, 16, 32)})
"""Injected costs: up to 4 rows the host computes a byte ten times faster than the link copies it, above 4 ten
times slower."""


@pytest.fixture
def ops(monkeypatch):
    recording = RecordingOps()
    monkeypatch.setattr(standalone, "device_ops", lambda device: recording)
    return recording


def _block_copies_per_forward(model: nn.Module, ops: RecordingOps, run) -> list[tuple[int, int]]:
    """(input rows, copies of decoder-layer units) for each forward of `model` while `run()` runs."""
    streamer = applied_state(model).tree.fetcher
    layers = {unit.host_range().data_ptr() for unit in streamer.units if unit.block is not None}
    starts = []
    model.register_forward_pre_hook(lambda m, a, k: starts.append((len(ops.log), k["input_ids"].shape[1])),
                                    with_kwargs=True)
    run()
    ends = [start for start, _ in starts[1:]] + [len(ops.log)]
    return [(rows, sum(1 for entry in ops.log[start:end] if entry[0] == "copy" and entry[2] in layers))
            for (start, rows), end in zip(starts, ends, strict=True)]


def test_decode_computes_on_the_host_and_the_prompt_streams_from_the_costs(ops):
    torch.manual_seed(0)
    resident = tiny_qwen2(num_hidden_layers=3)
    streamwise.apply_policy(resident, "decoder-llm")
    model = copy.deepcopy(resident)
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=0,
                                host_compute=on_host.StreamCosts(**DECODE_ON_HOST))
    assert report.host_blocks == 3 and "3 blocks compute on the host" in str(report)
    ids = torch.randint(0, 128, (1, 12))

    with torch.no_grad():
        copies = _block_copies_per_forward(model, ops, lambda: model.generate(ids, **GREEDY))
        got = model.generate(ids, **GREEDY)
    assert copies[0] == (12, 3)  # the prompt (16 rows' costs): every layer streamed
    # each decode step: every layer on the host, nothing copied; the first may still prefetch the block the prompt's
    # forward computed after the embedding (the order the ring learned)
    assert copies[1][0] == 1 and copies[1][1] <= 1 and copies[2:] == [(1, 0)] * 3
    assert torch.equal(got, resident.generate(ids, **GREEDY))
    assert not [entry for entry in ops.log if entry[0] == "synchronize"]  # the costs were given: nothing timed


def test_costs_left_out_are_measured_once_each_and_named(ops, caplog):
    torch.manual_seed(0)
    resident = tiny_qwen2(num_hidden_layers=3)
    streamwise.apply_policy(resident, "decoder-llm")
    model = copy.deepcopy(resident)
    costs = on_host.StreamCosts()
    with caplog.at_level("INFO", logger="streamwise.offload"):
        streamwise.offload(model, "decoder-llm", device="cpu", budget=0, host_compute=costs)
    assert costs.link is not None and ops.log.count(("synchronize",)) == 2  # one copy timed when placing
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad(), caplog.at_level("INFO", logger="streamwise.offload"):
        placed = len(ops.log)
        expected = resident.generate(ids, **GREEDY)
        assert torch.equal(model.generate(ids, **GREEDY), expected)
        assert set(costs.host) == {8, 1}  # the prompt's size, and the steps'
        assert ops.log[placed:].count(("synchronize",)) == 2  # one block of each size timed
        settled = len(ops.log)
        assert torch.equal(model.generate(ids, **GREEDY), expected)
    assert ("synchronize",) not in ops.log[settled:]
    assert "the link copies" in caplog.text and "(`model.layers.0`, measured)" in caplog.text


def test_a_gguf_block_on_the_host_computes_with_the_cpu_kernels(ops, tmp_path, monkeypatch):
    """A GGUF model's layers computed on the host read their stored blocks through the CPU kernels, as the same file
    loaded resident on the CPU does."""
    tokens, _, eos = parts = train_tokenizer_parts()
    path = tmp_path / "tiny.Q8_0.gguf"
    floats = write_llama_cpp_gguf(float_model("llama", len(tokens), eos), path, "llama", gguf.GGMLQuantizationType.Q8_0,
                                  parts)  # the float model the file holds
    resident, _, _ = streamwise.load_pretrained(path, "auto")
    model, _, _ = streamwise.load_pretrained(path, "auto")
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=0,
                                host_compute=on_host.StreamCosts(**DECODE_ON_HOST))
    assert report.host_blocks == 2
    kernels = numba_kernels.matmul()
    calls = []
    original = kernels.matmul
    monkeypatch.setattr(kernels, "matmul", lambda *args: calls.append(args[0].shape[0]) or original(*args))
    ids = torch.tensor([[eos, 5, 17, 42, 99, 7]])
    greedy = dict(GREEDY, pad_token_id=eos)
    with torch.no_grad():
        got = model.generate(ids, **greedy)
    assert calls.count(1) >= 4 * 2 * 7  # every layer's 7 Linears, at each decode step, through the kernels
    calls.clear()
    with torch.no_grad():
        host_logits = model(ids[:, :4]).logits  # 4 rows: the host's size by the costs
    assert calls.count(4) >= 2 * 7
    monkeypatch.setattr(kernels, "matmul", original)
    with torch.no_grad():
        assert torch.equal(got, resident.generate(ids, **greedy))
        want = floats(ids[:, :4]).logits
    assert ((host_logits - want).norm() / want.norm()).item() < 2e-2  # int8 arithmetic, against the file's floats


def test_an_operation_mixing_devices_runs_where_the_block_computes():
    """A cache written on one device and read by a block computing on another (`meta` standing in for the GPU: torch
    refuses to mix it with the CPU in these operations, and nothing can be copied out of it)."""
    cache, step = torch.ones(2, 3), torch.zeros(1, 3, device="meta")
    with on_host._OneDevice(torch.device("meta")):
        appended = torch.cat([cache, step])  # out of place: where the block computes
    assert appended.device.type == "meta" and appended.shape == (3, 3)
    with on_host._OneDevice(torch.device("cpu")):
        written = torch.zeros(2, 3, device="meta")
        written.index_copy_(0, torch.tensor([1]), torch.full((1, 3), 2.0))  # in place: where its target lies
        into = torch.empty(3, 3, device="meta")
        torch.cat([torch.ones(2, 3), torch.zeros(1, 3)], out=into)
    assert written.device.type == "meta" and into.device.type == "meta"


def test_placing_again_takes_the_host_forwards_back(ops):
    torch.manual_seed(0)
    model = tiny_qwen2()
    streamwise.offload(model, "decoder-llm", device="cpu", budget=0,
                       host_compute=on_host.StreamCosts(**DECODE_ON_HOST))
    assert all(isinstance(layer.__dict__.get("forward"), on_host.OnHost) for layer in model.model.layers)
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=0)
    assert report.host_blocks == 0 and not any("forward" in layer.__dict__ for layer in model.model.layers)


def test_a_failure_while_installing_leaves_no_host_forward(ops, monkeypatch):
    torch.manual_seed(0)
    model = tiny_qwen2()
    made = []

    class Failing(on_host.OnHost):  # the second block's forward fails to install
        def __init__(self, *args):
            if made:
                raise RuntimeError("planted")
            made.append(args)
            super().__init__(*args)

    monkeypatch.setattr(on_host, "OnHost", Failing)
    with pytest.raises(standalone.OffloadError, match="planted"):
        streamwise.offload(model, "decoder-llm", device="cpu", budget=0,
                           host_compute=on_host.StreamCosts(**DECODE_ON_HOST))
    assert made and not any("forward" in layer.__dict__ for layer in model.model.layers)


def test_a_compiled_policy_keeps_every_block_on_the_device(ops, caplog):
    torch.manual_seed(0)
    model = tiny_qwen2()
    policy = streamwise.load_policy("decoder-llm")
    policy = policy.model_copy(update={"compile": policy.compile.model_copy(update={"enabled": True})})
    with caplog.at_level("WARNING", logger="streamwise.offload"):
        report = streamwise.offload(model, policy, device="cpu", budget=0, host_compute=True)
    assert report.host_blocks == 0 and "host_compute is off" in caplog.text
