"""Several devices through accelerate: the device map from a Plan, and `dispatch` on this machine's CPU."""

from __future__ import annotations

import copy
import sys
from collections import Counter

import pytest
import torch

from helpers import tiny_qwen2

pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
transformers = pytest.importorskip("transformers")

from accelerate.utils import check_device_map, compute_module_sizes, infer_auto_device_map  # noqa: E402

import streamwise  # noqa: E402
from streamwise.runtime.convert import applied_state  # noqa: E402
from streamwise.runtime.engine import protocol  # noqa: E402
from streamwise.runtime.engine.stream.streamer import UnitStreamer  # noqa: E402
from streamwise.runtime.hosts.dispatch import DispatchError, budgets, dispatch, infer_device_map  # noqa: E402

GIB = 2**30
BUDGETS = {"cuda:0": "20GiB", "cuda:1": "20GiB", "cpu": "64GiB"}


def meta_model(cls, config):
    with torch.device("meta"):
        return cls(config)


@pytest.fixture(scope="module")
def qwen2():
    """transformers' default Qwen2 (7B-class, 32 layers, fp32 on meta: 35 GB), with the decoder-llm plan."""
    model = meta_model(transformers.Qwen2ForCausalLM, transformers.Qwen2Config())
    return model, streamwise.resolve(streamwise.load_policy("decoder-llm"), model)


def per_device(device_map, sizes):
    totals = Counter()
    for name, device in device_map.items():
        totals[str(device) if not isinstance(device, int) else f"cuda:{device}"] += sizes[name]
    return dict(totals)


def blocks_of(plan):
    return [entry.path for entry in plan.modules if entry.compile_unit]


def test_map_is_what_dispatch_model_takes_and_keeps_blocks_whole(qwen2):
    model, plan = qwen2
    device_map = infer_device_map(model, plan, BUDGETS)
    check_device_map(model, device_map)  # accelerate's own check: every tensor covered
    blocks = blocks_of(plan)
    assert len(blocks) == 32
    for name in device_map:
        assert not any(name.startswith(block + ".") for block in blocks), f"{name} splits a block"
    assert all(device_map[block] in ("cuda:0", "cuda:1", "cpu") for block in blocks)
    # in order: blocks fill cuda:0, then cuda:1, then the cpu entry; never back
    order = [device_map[block] for block in blocks]
    assert order == sorted(order, key=["cuda:0", "cuda:1", "cpu"].index)
    assert set(order) == {"cuda:0", "cuda:1", "cpu"}
    # the rotary table is no streamed leaf's: it must live on an accelerator
    assert device_map["model.rotary_emb"] != "cpu"


def test_map_figures_against_accelerates_infer_auto_device_map(qwen2):
    model, plan = qwen2
    sizes = compute_module_sizes(model)
    device_map = infer_device_map(model, plan, BUDGETS)
    ours = per_device(device_map, sizes)
    theirs = per_device(infer_auto_device_map(
        model, max_memory={0: "20GiB", 1: "20GiB", "cpu": "64GiB"},
        no_split_module_classes=model._no_split_modules), sizes)
    print("\nstreamwise:", ours, "\naccelerate:", theirs)
    assert sum(ours.values()) == sum(theirs.values()) == sizes[""]
    block = sizes["model.layers.0"]
    largest_leaf = max(sizes[entry.path] for entry in plan.modules if entry.stream)  # the embedding / lm_head
    on_cpu = [entry for entry, device in device_map.items() if device == "cpu"]
    ring = UnitStreamer.SLOTS * max(sizes[entry] for entry in on_cpu)  # the streaming engine's slots, each an entry
    for device in ("cuda:0", "cuda:1"):
        assert ours[device] <= 20 * GIB
        # accelerate keeps its largest layer's room on the first accelerator, we the ring's on the last one (the
        # cpu tail runs there): the shares differ by at most the larger room plus the block it displaces
        assert abs(ours[device] - theirs[device]) <= max(largest_leaf, ring) + block
    assert abs(ours["cpu"] - theirs["cpu"]) <= max(largest_leaf, ring) + block
    # the last accelerator keeps room for the ring the cpu entries stream through
    assert ours["cuda:1"] + ring <= 20 * GIB


def test_tied_weights_share_a_device():
    config = transformers.LlamaConfig(tie_word_embeddings=True, num_hidden_layers=8)
    model = meta_model(transformers.LlamaForCausalLM, config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = streamwise.resolve(streamwise.load_policy("decoder-llm"), model)
    sizes = compute_module_sizes(model)
    embedding, layer, slack = sizes["model.embed_tokens"], sizes["model.layers.0"], 2**20  # slack: rotary table
    for room in (embedding + layer + slack, embedding + 5 * layer):  # the tied pair on cuda:0 either way
        device_map = infer_device_map(model, plan, {"cuda:0": room, "cuda:1": 4 * layer, "cpu": "64GiB"})
        assert device_map["lm_head"] == device_map["model.embed_tokens"] == "cuda:0"
    # the only accelerator must keep room for the ring it streams the cpu entries through (two of the largest,
    # a layer), so the embedding cannot stay there: both go to the cpu entry, streamed, and the rotary table (no
    # leaf's) takes the room left
    ring = UnitStreamer.SLOTS * layer
    device_map = infer_device_map(model, plan, {"cuda:0": ring + slack, "cpu": "64GiB"})
    assert device_map["lm_head"] == device_map["model.embed_tokens"] == "cpu"
    assert device_map["model.rotary_emb"] == "cuda:0"


def test_a_module_held_at_several_paths_is_placed_once_with_what_shares_it():
    """T5's `shared` embedding is also the encoder's and the decoder's `embed_tokens` (and the lm_head's weight)."""
    model = meta_model(transformers.T5ForConditionalGeneration, transformers.T5Config(num_layers=4))
    sizes = compute_module_sizes(model)
    ring = UnitStreamer.SLOTS * max(sizes[f"decoder.block.{i}"] for i in range(4))  # the last accelerator's room
    budget = {"cuda:0": sizes[""] // 2, "cuda:1": sizes[""] // 4 + ring, "cpu": "64GiB"}
    device_map = infer_device_map(model, "auto", budget)  # a policy, resolved there
    check_device_map(model, device_map)
    tied = {device_map[name] for name in ("shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head")}
    assert len(tied) == 1 and len(set(device_map.values())) == 3


def test_the_map_needs_no_accelerate_when_budgets_are_given(monkeypatch, qwen2):
    model, plan = qwen2
    expected = infer_device_map(model, plan, BUDGETS)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    assert infer_device_map(model, plan, BUDGETS) == expected
    with pytest.raises(DispatchError, match="not installed"):
        infer_device_map(model, plan, None)  # the free memory is accelerate's to read


def test_budgets_as_users_write_them():
    assert budgets({"cuda:0": "1.5GB", 1: 2048, "cpu": "64GiB"}) == {"cuda:0": 1_500_000_000, "cuda:1": 2048,
                                                                     "cpu": 64 * GIB}
    assert list(budgets({"cpu": 1, "cuda:1": 2, "cuda:0": 3})) == ["cuda:1", "cuda:0", "cpu"]
    assert budgets({"cuda": "1GiB"}) == {"cuda:0": GIB, "cpu": 0}
    assert budgets({"disk": "1TB", "cpu": 1}) == {"cpu": 1, "disk": 10**12}  # the file tier, as accelerate spells it
    for bad, says in [({"cuda:0": "lots"}, "write bytes with a unit"), ({"cuda:0": -1}, "not negative"),
                      ({"cuda:0": True}, "a number of bytes"), ({"meta": 1}, "meta"),
                      ({"gpu:0": 1}, "not a device"), ({"cuda:0": 1, "cuda": 2}, "twice"), ({}, "mapping"),
                      ({"cpu": float("inf")}, "finite")]:
        with pytest.raises(DispatchError, match=says):
            budgets(bad)


def test_what_fits_nowhere_is_a_clear_error(qwen2):
    model, plan = qwen2
    with pytest.raises(DispatchError, match="fits no device"):
        infer_device_map(model, plan, {"cuda:0": "20GiB", "cpu": "1GiB"})


def test_dispatch_on_cpu_streams_and_matches_the_unconverted_model():
    torch.manual_seed(0)
    model = tiny_qwen2()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 9))
    report = dispatch(model, "decoder-llm", max_memory={"cpu": "1GiB"})
    assert model.hf_device_map == report.device_map
    assert set(report.device_map.values()) == {"cpu"}
    check_device_map(model, report.device_map)
    assert hasattr(model, "_hf_hook")  # accelerate's root hook: inputs to the main device, outputs back
    assert report.streamed_modules == sum(1 for m in model.modules() if protocol.kind_of(m)) > 0
    assert all(protocol.is_fetching(m) for m in model.modules() if protocol.kind_of(m))
    assert report.bytes["cpu"] == compute_module_sizes(model)[""]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_the_cpu_entries_stream_by_units_through_the_engine(monkeypatch):
    """Each "cpu" entry's streamed leaves are one unit of the streaming engine (the recording fake device here):
    one copy per entry per forward, into the ring, and the numbers of the unconverted model."""
    from recording_device import RecordingOps

    from streamwise.runtime.hosts import dispatch as host

    ops = RecordingOps()
    monkeypatch.setattr(host, "device_ops", lambda device: ops)
    torch.manual_seed(0)
    model = tiny_qwen2(num_hidden_layers=3)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 9))
    report = dispatch(model, "decoder-llm", max_memory={"cpu": "1GiB"})
    streamer = applied_state(model).tree.fetcher
    assert isinstance(streamer, UnitStreamer)
    entries = {entry for entry, device in report.device_map.items() if device == "cpu"
               if any(protocol.kind_of(m) for m in model.get_submodule(entry).modules())}
    assert len(streamer.units) == len(entries) > 3  # the three layers, the embedding, the head...
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        settled = len(ops.log)
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert sum(entry[0] == "copy" for entry in ops.log[settled:]) == len(streamer.units)


def test_dispatch_that_fails_leaves_the_tree_as_it_was():
    model = tiny_qwen2()
    classes = [type(m) for m in model.modules()]
    with pytest.raises(DispatchError, match="fits no device"):
        dispatch(model, "decoder-llm", max_memory={"cpu": 1000})
    assert applied_state(model) is None
    assert [type(m) for m in model.modules()] == classes
    assert not any("_hf_hook" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    assert not hasattr(model, "hf_device_map")


def test_devices_this_machine_lacks_are_refused_before_anything_changes():
    model = tiny_qwen2()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DispatchError, match="cuda"):
        dispatch(model, "decoder-llm", max_memory={f"cuda:{count}": "1GiB", "cpu": "1GiB"})
    assert applied_state(model) is None


def test_without_accelerate_the_error_says_what_to_install(monkeypatch):
    for name in [name for name in sys.modules if name == "accelerate" or name.startswith("accelerate.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    model = tiny_qwen2()
    with pytest.raises(DispatchError, match=r"pip install 'streamwise\[accelerate\]'"):
        dispatch(model, "decoder-llm", max_memory={"cpu": "1GiB"})
    assert applied_state(model) is None
