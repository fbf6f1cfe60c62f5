"""Streaming by units (`engine.stream`), its schedule read from the recording fake device on the CPU: one copy per
block, issued before the block before it computes; slots written again only after their last use; nothing made or
waited on by the host once placed; changed weights seen; every kind computing exactly what it computes resident."""

from __future__ import annotations

import copy
import itertools
import logging
import threading

import gguf
import pytest
import torch
from recording_device import RecordingOps
from torch import nn

import streamwise
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
from streamwise.runtime.convert import applied_state
from streamwise.runtime.engine import file_tier, protocol
from streamwise.runtime.engine.stream.measure import ForwardTimes
from streamwise.runtime.engine.stream.streamer import UnitStreamer
from streamwise.runtime.hosts import standalone
from streamwise.runtime.quant import gguf_dequant
from streamwise.runtime.sizes import human

from helpers import make_policy, stream_rule, tiny_qwen2
from llama_cpp_files import float_model, train_tokenizer_parts, write_llama_cpp_gguf


@pytest.fixture
def ops(monkeypatch):
    recording = RecordingOps()
    monkeypatch.setattr(standalone, "device_ops", lambda device: recording)
    return recording


def _quantizing(format_name: str):
    """decoder-llm, with every Linear quantized on apply."""
    rule = {"id": "q", "format": format_name, "select": {"class": "Linear"},
            **({"group_size": 64} if format_name.startswith("convrot") else {})}
    return streamwise.load_policy("decoder-llm").model_copy(update={"quant": make_policy(quant={"rule": [rule]}).quant})


def _streamed(model: nn.Module, policy, ops: RecordingOps) -> UnitStreamer:
    report = streamwise.offload(model, policy, device="cpu", budget=0)
    assert report.resident_modules == 0
    streamer = applied_state(model).tree.fetcher
    assert isinstance(streamer, UnitStreamer)
    return streamer


def _logging_compute(model: nn.Module, streamer: UnitStreamer, log: list) -> None:
    """Log each streamed leaf's compute (after its fetch) into the fake's log, by its unit's index."""
    for index, unit in enumerate(streamer.units):
        for leaf in unit.leaves:
            leaf.register_forward_hook(lambda m, a, o, i=index: log.append(("compute", i)))


@pytest.mark.parametrize("policy", ["decoder-llm", "int8", "convrot_int8"])
def test_every_kind_streams_by_blocks_and_computes_what_it_computes_resident(ops, policy):
    torch.manual_seed(0)
    resident = tiny_qwen2()
    chosen = "decoder-llm" if policy == "decoder-llm" else _quantizing(policy)
    streamwise.apply_policy(resident, chosen)
    model = copy.deepcopy(resident)
    streamer = _streamed(model, chosen, ops)
    ids = torch.randint(0, 128, (1, 7))

    with torch.no_grad():
        got, expected = model(ids).logits, resident(ids).logits
        settled = len(ops.log)
        again = model(ids).logits

    assert torch.equal(got, expected) and torch.equal(again, expected)
    paths = {id(m): p for p, m in model.named_modules()}
    layer_units = [u for u in streamer.units if paths[id(u.leaves[0])].startswith("model.layers.")]
    assert len(layer_units) == 2  # a decoder layer (its 7 Linears and 2 norms): one unit
    assert all(sum(isinstance(leaf, nn.Linear) for leaf in u.leaves) == 7 for u in layer_units)
    copies = [entry for entry in ops.log[settled:] if entry[0] == "copy"]
    assert len(copies) == len(streamer.units)  # one copy per unit per forward: every unit lies together


def test_a_generic_container_streams_what_it_claims_in_one_copy(ops):
    torch.manual_seed(0)
    resident = tiny_qwen2(num_hidden_layers=3)  # more units than the ring's two slots: each copied per forward
    policy = make_policy(stream={"rule": [stream_rule("blocks", "generic", path="model.layers.*")]},
                         relocate={"rule": [{"id": "rest", "select": {"path": ["model.norm", "model.rotary_emb"]}}]})
    model = copy.deepcopy(resident)
    streamer = _streamed(model, policy, ops)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)
        settled = len(ops.log)
        assert torch.equal(model(ids).logits, resident(ids).logits)
    assert len(streamer.units) == 3 and sum(e[0] == "copy" for e in ops.log[settled:]) == 3


def test_the_next_block_is_copied_before_this_one_computes_and_a_slot_waits_for_its_last_use(ops):
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=4)
    streamer = _streamed(model, "decoder-llm", ops)
    log = ops.log
    _logging_compute(model, streamer, log)
    settled = len(log)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        model(ids)
        model(ids)

    forward = log[settled:]
    host = {unit.host_range().data_ptr(): i for i, unit in enumerate(streamer.units)}
    first_compute = {}
    for position, entry in enumerate(forward):
        if entry[0] == "compute":
            first_compute.setdefault(entry[1], position)
    copied_at = {}
    for position, entry in enumerate(forward):
        if entry[0] == "copy":
            copied_at.setdefault(host[entry[2]], position)
    units = len(streamer.units)
    for i in range(units - 1):  # unit i+1's copy is issued before unit i computes
        assert copied_at[i + 1] < first_compute[i], (i, forward)
    # a copy into a slot used before waits for its free event, recorded after the last compute of the unit it held
    held: dict[int, int] = {}
    for position, entry in enumerate(forward):
        if entry[0] != "copy":
            continue
        slot, unit = entry[1], host[entry[2]]
        if slot in held:
            free = streamer.slots[slot].free
            waited = max(p for p in range(position) if forward[p] == ("copy_after", free))
            recorded = max(p for p in range(waited) if forward[p] == ("computed", free))
            used = max((p for p in range(position) if forward[p] == ("compute", held[slot])), default=-1)
            assert used < recorded < waited < position, (slot, position)
        held[slot] = unit
    assert not {kind for kind, *_ in forward} & {"buffer", "event"}  # nothing made once placed
    assert sum(e[0] == "buffer" for e in log[:settled]) == len(streamer.slots) == 2


def test_weights_changed_in_place_or_replaced_between_forwards_are_seen(ops):
    torch.manual_seed(0)
    resident = tiny_qwen2()
    streamwise.apply_policy(resident, "decoder-llm")
    model = copy.deepcopy(resident)
    _streamed(model, "decoder-llm", ops)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        model(ids)  # the first unit's copy for the next forward is made at the end of this one (wrap-around)
        for tree in (model, resident):
            tree.model.embed_tokens.weight.mul_(1.5)  # in place, in the unit copied ahead: an optimizer step
            tree.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # in place: a merged LoRA
        assert torch.equal(model(ids).logits, resident(ids).logits)
        for tree in (model, resident):
            layer = tree.model.layers[0].self_attn.q_proj
            layer.weight = nn.Parameter(layer.weight.detach() * 0.5)  # replaced: a fresh Parameter
        assert torch.equal(model(ids).logits, resident(ids).logits)
        for tree in (model, resident):
            tree.model.layers[1].mlp.down_proj.weight.data = tree.model.layers[1].mlp.down_proj.weight.data + 1
        assert torch.equal(model(ids).logits, resident(ids).logits)


def test_the_ring_is_counted_in_the_budget(ops):
    torch.manual_seed(0)
    model = tiny_qwen2()
    budget = sum(p.nbytes for p in model.parameters()) * 95 // 100  # the ring takes two decoder layers' room
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=budget)
    streamer = applied_state(model).tree.fetcher
    ring = sum(slot.buffer.nbytes for slot in streamer.slots)
    assert report.streamed_modules > 0 and ring > 0 and report.resident_bytes + ring <= budget


def test_the_gpu_benchmark_runs_end_to_end_against_the_fake_device(tmp_path):
    """`benchmarks/gpu_stream.py --dry-run`: a GPU run cannot fail on a typo its first minutes would find."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, "gpu_stream.py", "--dry-run", "--quick", "--tokens", "4", "--out", str(out)],
                          cwd=benchmarks, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    for name in ("bf16-eager-host-standalone", "bf16-eager-host-measured", "q8_0-eager-host-standalone",
                 "int8-eager-host-standalone"):
        assert figures[name]["identical_to_resident"] and figures[name]["streamed_bytes"] > 0, figures[name]
    assert "spread along the compute of one measuring forward" in figures["bf16-eager-host-measured"]["report"]
    rewrite = figures["rewrite"]
    assert rewrite["host"]["after_the_rewrite"] == "the same tokens", rewrite
    assert rewrite["file"]["file_bytes"] > 0 and rewrite["file"]["after_the_rewrite"].startswith("CheckpointError"), \
        rewrite


def test_the_gguf_decode_benchmark_runs_end_to_end_against_the_fake_device(tmp_path):
    """`gpu_stream.py --dry-run --decode-only` (issue 56's decode run): the Q8_0 and Q4_K decoders streamed whole
    decode the tokens of the same files resident, each against its link time."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, "gpu_stream.py", "--dry-run", "--decode-only", "--tokens", "8", "--out",
                           str(out)], cwd=benchmarks, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    for name in ("decode-q8_0", "decode-q4_k"):
        assert figures[name]["same_tokens_as_resident"] and figures[name]["link_ms"] > 0, figures[name]


def test_a_weight_grown_past_its_slot_is_refused_naming_the_unit(ops):
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=3)
    _streamed(model, "decoder-llm", ops)
    ids = torch.randint(0, 128, (1, 4))
    layer = model.model.layers[1].mlp.up_proj
    layer.weight = nn.Parameter(torch.randn(layer.out_features * 4, layer.in_features))  # past two layers' slot
    with torch.no_grad(), pytest.raises(RuntimeError, match="`model.layers.1` grew to .* offload the model again"):
        model(ids)


@pytest.mark.parametrize("share", [0.75, 0.9])
def test_streamed_blocks_are_spread_among_resident_ones(ops, share):
    """Each streamed layer's copy overlaps resident layers' compute: no two streamed layers follow each other (greedy
    residency in order, the plant tried, streams the last layers together)."""
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=8)
    budget = int(sum(p.nbytes for p in model.parameters()) * share)
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=budget)
    streamer = applied_state(model).tree.fetcher
    layers = [int(unit.name.rsplit(".", 1)[1]) for unit in streamer.units if unit.name.startswith("model.layers.")]
    assert len(layers) >= 3, layers
    assert all(later - earlier > 1 for earlier, later in itertools.pairwise(layers)), layers
    assert report.resident_bytes + sum(slot.buffer.nbytes for slot in streamer.slots) <= budget


FILE_IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def _streamed_from_its_file(tmp_path) -> tuple[nn.Module, UnitStreamer, torch.Tensor]:
    """A tiny Qwen2 saved with `save_pretrained`, loaded under a host budget that leaves most of it in its file and
    streamed at budget 0 (through the fake device); with the logits of the same folder loaded whole."""
    torch.manual_seed(0)
    tiny_qwen2(tie_word_embeddings=False).save_pretrained(tmp_path)
    with torch.no_grad():
        expected = streamwise.load_pretrained(tmp_path, "auto", progress=False).model(FILE_IDS).logits
    model = streamwise.load_pretrained(tmp_path, "auto", progress=False, max_memory={"cpu": 96 << 10}).model
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=0)
    assert report.file_bytes > 0
    return model, applied_state(model).tree.fetcher, expected


def test_leaves_on_the_file_tier_stream_through_the_ring_read_ahead_by_the_tier(ops, tmp_path, monkeypatch):
    """Leaves left in their file (a host budget below the model) are units of the ring: read by the tier's reader
    thread ahead of their turn into its staging, one copy per tensor into a slot, the staging held until the copy is
    done; the numbers are those of the model loaded whole."""
    from streamwise.runtime.checkpoint.checked_file import CheckedFile

    model, streamer, expected = _streamed_from_its_file(tmp_path)
    ids = FILE_IDS
    in_file = [unit for unit in streamer.units if unit.in_file]
    assert in_file and all(len(unit.leaves) == 1 for unit in in_file)
    readers = []
    read_into = CheckedFile.read_into
    monkeypatch.setattr(CheckedFile, "read_into", lambda file, ranges, **options: readers.append(
        (threading.current_thread().name, ranges[0][0])) or read_into(file, ranges, **options))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
        readers.clear()
        settled = len(ops.log)
        assert torch.equal(model(ids).logits, expected)
    arenas = [arena.buffer for arena in applied_state(model).tree.file_tier._pool]
    staged = [entry for entry in ops.log[settled:] if entry[0] == "copy"
              and any(a.data_ptr() <= entry[2] < a.data_ptr() + a.nbytes for a in arenas)]
    assert len(staged) >= len(in_file)  # every unit on the file tier copied from the staging
    starts = {next(iter(file_tier.sources(leaf).values())).range.offset for unit in in_file for leaf in unit.leaves}
    by_thread = [thread for thread, offset in readers if offset in starts]
    read = {offset for _, offset in readers} & starts  # those still in a slot since the last forward need none
    assert len(read) >= len(in_file) - UnitStreamer.SLOTS, (readers, starts)
    assert by_thread.count("MainThread") <= 1, by_thread
    assert not {kind for kind, *_ in ops.log[settled:]} & {"buffer", "event"}


def test_a_file_changed_under_the_ring_is_the_readers_error(ops, tmp_path):
    from streamwise.runtime.checkpoint.readers import CheckpointError

    model, _, _ = _streamed_from_its_file(tmp_path)
    with torch.no_grad():
        model(FILE_IDS)
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # the last tensor's tail, in place: same size
    path.write_bytes(bytes(data))
    with torch.no_grad(), pytest.raises(CheckpointError):
        model(FILE_IDS)


def test_staging_a_copy_may_still_read_is_never_read_into_again(ops, tmp_path, monkeypatch):
    """Copies that never report done (a GPU far behind the host): what they read stays held and unwritten, and the
    tier reads into other memory meanwhile; the numbers stay those of the model loaded whole."""
    model, streamer, expected = _streamed_from_its_file(tmp_path)
    monkeypatch.setattr(ops, "finished", lambda event: False)
    copied = []
    copy_now = ops.copy
    monkeypatch.setattr(ops, "copy", lambda destination, source: copied.append((source.data_ptr(), source.clone()))
                        or copy_now(destination, source))  # no reference: it would keep the staging from reuse
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(FILE_IDS).logits, expected)
    held = {t.data_ptr() for slot in streamer.slots for t in slot.staged} \
        | {t.data_ptr() for _, tensors in streamer.retiring for t in tensors}
    staged = []  # each copy read from the tier's arenas: where it read, what it read then
    for address, then in copied:
        for arena in applied_state(model).tree.file_tier._pool:
            offset = address - arena.buffer.data_ptr()
            if 0 <= offset < arena.buffer.nbytes:
                staged.append((address, arena.buffer[offset:offset + then.nbytes], then))
    assert all(torch.equal(now, then) for _, now, then in staged)  # none written since its copy
    assert streamer.retiring and any(address in held for address, _, _ in staged)
    assert len(staged) < len(copied)  # with its arenas held, the tier read into memory of its own


def test_quantized_weights_expand_into_one_reused_buffer_counted_in_the_budget(ops, tmp_path, monkeypatch):
    """GGUF weights expanded at a call on the device (float32 arithmetic here: no kernel reads them in place) are
    written into the tree's one expansion buffer, made with the ring and counted in the budget, resident and
    streamed layers alike, with the resident model's numbers; a forward asking gradients expands into memory of its
    own (autograd keeps the weight). Fails when the expansion takes memory of its own (`expansion` -> None: tried)."""
    tokens, _, eos = parts = train_tokenizer_parts()
    path = tmp_path / "tiny.Q8_0.gguf"
    write_llama_cpp_gguf(float_model("llama", len(tokens), eos), path, "llama", gguf.GGMLQuantizationType.Q8_0, parts)
    resident = streamwise.load_pretrained(path, "auto", arithmetic="float32")[0]
    model = streamwise.load_pretrained(path, "auto", arithmetic="float32")[0]
    residents = [m for m in model.modules() if protocol.is_resident(m)]
    largest = max(m.out_features * m.in_features * 4 for m in residents)  # float32: the file's compute dtype
    total = streamwise.offload(copy.deepcopy(model), "decoder-llm", device="cpu", budget=0).streamed_bytes
    budget = total + largest * 9 // 10  # less the ring and the buffer: some layers resident (the embedding too)
    report = streamwise.offload(model, "decoder-llm", device="cpu", budget=budget)
    streamer = applied_state(model).tree.fetcher
    assert report.expansion_bytes == largest == streamer.expansion_buffer.numel()
    assert f"quantized weights expand into one {human(largest)} buffer" in str(report)
    on_device = [m for m in residents if not m.comfy_cast_weights]
    assert 0 < len(on_device) < len(residents)  # resident layers and streamed ones
    assert report.resident_bytes + UnitStreamer.ring_bytes(streamer.units) + largest <= report.budget
    into = []
    dequantize = gguf_dequant.dequantize
    monkeypatch.setattr(gguf_dequant, "dequantize",
                        lambda *args, out=None: into.append(out) or dequantize(*args, out=out))
    ids = torch.tensor([[eos, 5, 17, 42, 99, 7]])
    with torch.no_grad():
        got = model(ids).logits
    buffer = streamer.expansion_buffer.data_ptr()
    assert len(into) == len(residents) and all(out is not None and out.data_ptr() == buffer for out in into)
    into.clear()
    with torch.enable_grad():
        model.model.embed_tokens.weight.requires_grad_(True)
        model(ids).logits.sum().backward()
    assert into and all(out is None for out in into)
    monkeypatch.setattr(gguf_dequant, "dequantize", dequantize)
    with torch.no_grad():
        assert torch.equal(got, resident(ids).logits)


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_K"])
def test_gguf_residents_stream_by_blocks_in_their_blocks_and_compute_what_they_compute_resident(ops, tmp_path,
                                                                                                gguf_type):
    """A GGUF file Streamwise wrote (every Linear in `gguf_type`), loaded and streamed at budget 0: each decoder
    layer's raw blocks are one unit, one copy per unit per forward, and the logits are those of the same file loaded
    resident."""
    torch.manual_seed(0)
    source = tiny_qwen2(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    source.save_pretrained(tmp_path)
    rule = {"id": "q", "format": "gguf", "gguf_type": gguf_type, "select": {"class": "Linear"}}
    writing = streamwise.load_policy("decoder-llm").model_copy(
        update={"quant": make_policy(quant={"rule": [rule]}).quant})
    path = tmp_path / f"model-{gguf_type}.gguf"
    quantize_to_gguf(tmp_path / "model.safetensors", path, writing, source)
    resident = streamwise.load_pretrained(path, "decoder-llm", progress=False)[0]
    model = streamwise.load_pretrained(path, "decoder-llm", progress=False)[0]
    assert model.model.layers[0].mlp.up_proj.gguf_qtype == gguf.GGMLQuantizationType[gguf_type]
    streamer = _streamed(model, "decoder-llm", ops)
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        expected = resident(ids).logits
        assert torch.equal(model(ids).logits, expected)
        settled = len(ops.log)
        assert torch.equal(model(ids).logits, expected)
    paths = {id(m): p for p, m in model.named_modules()}
    assert sum(paths[id(u.leaves[0])].startswith("model.layers.") for u in streamer.units) == 2
    assert sum(entry[0] == "copy" for entry in ops.log[settled:]) == len(streamer.units)


def test_the_first_forward_is_timed_against_its_floor_and_no_later_one(ops, caplog):
    """Timers made when placing (four a unit) are recorded in the first forward only: around each unit's copy on the
    copy stream and around the compute stream's wait for it. Its figures are read at a later unit's entry once the
    timers are done (asked, never waited for: no synchronisation), logged and kept. Fails when every forward records
    its timers (tried: `recording` never cleared)."""
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=4)
    streamer = _streamed(model, "decoder-llm", ops)
    timers = {id(entry[1]) for entry in ops.log if entry[0] == "timer"}
    assert len(timers) == 4 * len(streamer.units)
    ids = torch.randint(0, 128, (1, 6))
    with caplog.at_level(logging.INFO, logger="streamwise.offload"), torch.no_grad():
        model(ids)
        assert streamer.measured is None  # read after the forward, at the next unit entered
        first = len(ops.log)
        model(ids)
        second = len(ops.log)
        model(ids)
    measured = streamer.measured
    assert measured is not None and measured.units == len(streamer.units)
    assert measured.compute > 0 and measured.copies > 0 and measured.waited >= 0
    assert f"offload: {measured}" in caplog.text and "its floor max(compute, copies)" in caplog.text
    later = ops.log[first:]
    assert not [entry for entry in later if entry[0] in ("copied", "computed") and id(entry[1]) in timers]
    assert ("synchronize",) not in later
    assert any(entry[0] == "seconds" for entry in ops.log[first:second])
    assert not any(entry[0] == "seconds" for entry in ops.log[second:])


def test_a_forward_is_judged_against_the_longer_of_its_compute_and_its_copies():
    copies_bound = ForwardTimes(units=8, compute=0.010, copies=0.020, waited=0.012)
    assert copies_bound.floor == 0.020 and copies_bound.ratio == pytest.approx(1.1)
    assert "1.10x its floor" in str(copies_bound) and "set by the copies" in str(copies_bound)
    hidden = ForwardTimes(units=8, compute=0.030, copies=0.020, waited=0.0)
    assert hidden.ratio == 1.0 and "set by the compute" in str(hidden)
