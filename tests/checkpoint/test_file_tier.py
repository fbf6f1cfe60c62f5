"""Models bigger than memory: a host budget leaves streamed units in their file, read at each forward.

Every case compares with the same file loaded without a budget (everything in memory): the tokens and logits are
the same, bit for bit, whatever stays in the file. The memory cases run in a child process, so a kill by the kernel
fails the test with its exit code instead of ending the run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import streamwise
from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
from streamwise.runtime.checkpoint.readers import CheckpointError
from streamwise.runtime.convert import ConversionError
from streamwise.runtime.engine import file_reads, file_tier
from streamwise.runtime.sizes import human

from helpers import REPO, MemoryCgroup, gguf_policy, leases_here, memory_cgroup, tiny_qwen2

INPUTS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def _saved(folder: Path, form: str) -> tuple[Path, str]:
    """A tiny Qwen2 written by the real libraries as `form`; the path to load and the policy to load it with."""
    torch.manual_seed(0)
    model = tiny_qwen2(tie_word_embeddings=False)
    if form == "safetensors":
        model.save_pretrained(folder)
        return folder, "auto"
    if form == "sharded":
        model.save_pretrained(folder, max_shard_size="60KB")
        assert (folder / "model.safetensors.index.json").is_file()
        return folder, "auto"
    model.save_pretrained(folder / "float")
    policy = gguf_policy(folder, "Q8_0")
    quantize_to_gguf(folder / "float" / "model.safetensors", folder / "float" / "model.gguf", policy, model)
    return folder / "float" / "model.gguf", str(policy)


def _logits_and_tokens(model) -> tuple[torch.Tensor, list[int]]:
    with torch.no_grad():
        return model(INPUTS).logits, model.generate(INPUTS, max_new_tokens=6, do_sample=False)[0].tolist()


@pytest.mark.parametrize("form", ["safetensors", "sharded", "gguf"])
def test_a_host_budget_leaves_units_in_the_file_and_computes_the_same(tmp_path, form):
    path, policy = _saved(tmp_path, form)
    whole = streamwise.load_pretrained(path, policy, progress=False)
    assert whole.report.tiers.file_bytes == 0
    # a quarter; the embedding gathers its rows: no staging
    budget = whole.report.bytes // 4 + whole.report.tiers.working_bytes
    tight = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": budget})
    tiers = tight.report.tiers
    assert tiers.file_units >= 4 and tiers.host_bytes + tiers.staging_bytes + tiers.working_bytes <= budget, tiers
    assert tiers.working_bytes == 0  # Q8_0 residents multiply from their blocks on the CPU: no room to expand them
    if form == "gguf":  # in the float32 arithmetic, room to expand the largest quantized weight (128 x 64) is kept
        expanding = 2 * 128 * 64 * 4
        exact = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": budget + expanding},
                                           arithmetic="float32")
        assert exact.report.tiers.working_bytes == expanding and exact.report.tiers.file_units == tiers.file_units
    assert "in the file" not in str(whole.report) and f"file {streamwise.runtime.sizes.human(tiers.file_bytes)}" \
        in str(tight.report)
    expected_logits, expected_tokens = _logits_and_tokens(whole.model)
    logits, tokens = _logits_and_tokens(tight.model)
    assert tokens == expected_tokens and torch.equal(logits, expected_logits)
    if form == "gguf":  # quantized blocks stay in the file raw, and stream as they are stored
        assert tight.report.quantized and any(file_tier.on_file_tier(m, "weight") and m._parameters["weight"].dtype
                                              == torch.uint8 for m in tight.model.modules())


def test_a_load_dtype_is_cast_at_each_fetch_of_a_weight_left_in_the_file(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    whole = streamwise.load_pretrained(path, policy, progress=False, dtype=torch.bfloat16).model
    tight = streamwise.load_pretrained(path, policy, progress=False, dtype=torch.bfloat16,
                                       max_memory={"cpu": 64 << 10}).model
    assert file_tier.in_file(tight.lm_head) and tight.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(_logits_and_tokens(tight)[0], _logits_and_tokens(whole)[0])


def test_a_weight_in_the_file_shows_model_code_its_dtype_shape_and_host_device(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    head = model.lm_head
    assert file_tier.on_file_tier(head, "weight")
    assert head.weight.dtype == torch.float32 and head.weight.shape == (128, 64) and head.weight.ndim == 2
    assert head.weight.device == torch.device("cpu") and not head.weight.is_meta  # `x.to(weight.device)` works
    assert isinstance(head.weight, torch.nn.Parameter) and isinstance(head.state_dict()["weight"], torch.Tensor)


def test_model_code_reading_a_weight_in_the_file_directly_gets_its_values(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    whole = streamwise.load_pretrained(path, policy, progress=False).model.lm_head.weight.detach()
    head = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model.lm_head
    x = torch.randn(3, 64)
    reads = {  # what modeling code does with a weight outside its own module's forward
        "F.linear": (lambda w: torch.nn.functional.linear(x, w)),
        ".T": (lambda w: w.T @ torch.ones(128)),
        ".to(dtype)": (lambda w: w.to(torch.bfloat16)),
        ".float()[0]": (lambda w: w.float()[0]),
        "x.to(w.dtype) @ w.t()": (lambda w: x.to(w.dtype) @ w.t()),
        "sum": (lambda w: w.sum(dim=0)),
    }
    for name, read in reads.items():
        got = read(head.weight)
        assert type(got) is torch.Tensor and torch.equal(got, read(whole)), name
    assert file_tier.on_file_tier(head, "weight")  # a direct read leaves it in the file


def test_a_write_into_a_weight_in_the_file_is_refused_naming_it(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    head = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model.lm_head
    written = r"`mul_` writes into its argument `self`, which is in the file tier \(.*model\.safetensors, at byte"
    with torch.no_grad(), pytest.raises(RuntimeError, match=written):
        head.weight.mul_(2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="would be lost"):
        head.load_state_dict({"weight": torch.zeros(128, 64)})
    assert file_tier.on_file_tier(head, "weight")


def test_the_plan_of_a_loaded_tree_says_what_is_in_its_file(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    whole = streamwise.load_pretrained(path, policy, progress=False)
    tight = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10})
    held = [m for m in tight.model.modules() if file_tier.in_file(m)]
    stored = sum(source.range.nbytes for m in held for source in file_tier.sources(m).values())
    chosen = streamwise.load_policy(streamwise.runtime.convert.applied_state(tight.model).plan.policy)
    plan = streamwise.resolve(chosen, tight.model)
    assert plan.summary()["in_file"] == {"bytes": stored, "modules": len(held)}
    assert f"in the file {streamwise.runtime.sizes.human(stored):>25}  ({len(held)} modules" in str(plan)
    assert "in_file" not in streamwise.resolve(chosen, whole.model).summary()


def test_a_state_dict_with_weights_in_the_file_saves_their_values(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    whole = streamwise.load_pretrained(path, policy, progress=False).model.state_dict()
    tight = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    torch.save(tight.state_dict(), tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert saved.keys() == whole.keys() and all(torch.equal(saved[k], whole[k]) for k in whole)


def test_moving_a_tree_keeps_its_file_tier_and_a_dtype_cast_applies_at_each_fetch(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    whole = streamwise.load_pretrained(path, policy, progress=False).model
    expected, _ = _logits_and_tokens(whole)
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    in_file = [m for m in model.modules() if file_tier.in_file(m)]
    assert in_file
    model.to("cpu")  # torch's `_apply` on every module: a placeholder alone would be read to be copied
    model.to(torch.device("cpu"), non_blocking=True)
    assert all(file_tier.in_file(m) for m in in_file)
    assert torch.equal(_logits_and_tokens(model)[0], expected)
    model.double()
    whole.double()
    assert model.lm_head.weight.dtype == torch.float64 and file_tier.on_file_tier(model.lm_head, "weight")
    with torch.no_grad():
        assert torch.equal(model(INPUTS).logits, whole(INPUTS).logits)
    model.to("meta")  # nothing is read from the file to move a tree anywhere
    assert all(file_tier.in_file(m) for m in in_file)


def test_two_threads_computing_with_one_tree_read_the_same_numbers(tmp_path):
    """The staging a thread's unit was read into stays its own while another thread's forward reads other units."""
    path, policy = _saved(tmp_path, "safetensors")
    expected, _ = _logits_and_tokens(streamwise.load_pretrained(path, policy, progress=False).model)
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    results, errors = [], []

    def forwards():
        try:
            for _ in range(8):
                with torch.no_grad():
                    results.append(model(INPUTS).logits)
        except Exception as exc:  # reported below, with the other threads
            errors.append(exc)

    threads = [threading.Thread(target=forwards) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 24
    assert all(torch.equal(logits, expected) for logits in results)


def test_a_move_that_fails_leaves_every_weight_in_its_file_as_it_was(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    expected, _ = _logits_and_tokens(model)
    placeholders = {(id(m), name): id(t) for m in model.modules() for name, t in m._parameters.items()
                    if file_tier.on_file_tier(m, name)}

    def unmovable(tensor):
        raise RuntimeError("no such device")

    with pytest.raises(RuntimeError, match="no such device"):
        model._apply(unmovable)  # what `model.to(device)` calls, failing as a missing device does
    assert placeholders and {(id(m), name): id(t) for m in model.modules() for name, t in m._parameters.items()
                             if file_tier.on_file_tier(m, name)} == placeholders
    assert torch.equal(_logits_and_tokens(model)[0], expected)


def test_offload_moves_units_between_device_host_and_file_and_computes_the_same(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    expected, _ = _logits_and_tokens(streamwise.load_pretrained(path, policy, progress=False).model)
    loaded = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 96 << 10})
    for budget in (0, 48 << 10, None):
        report = streamwise.offload(loaded.model, "decoder-llm", device="cpu", budget=budget)
        assert report.file_bytes > 0 and report.host_budget == 96 << 10, report
        assert report.resident_bytes + report.streamed_bytes - report.file_bytes <= 96 << 10
        logits, _ = _logits_and_tokens(loaded.model)
        assert torch.equal(logits, expected), budget
    roomy = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": "64MiB"})
    report = streamwise.offload(roomy.model, "decoder-llm", device="cpu", budget=0)
    assert report.file_bytes == 0  # everything fits the host: nothing is read from the file
    assert torch.equal(_logits_and_tokens(roomy.model)[0], expected)


def test_dispatch_leaves_what_fits_no_device_in_its_file_under_disk_and_reads_it_back(tmp_path):
    """accelerate's `"disk"` entry is the file tier: streamed leaves past the cpu budget stay in the checkpoint;
    a later dispatch with room reads them back; a tree not loaded from a file is refused before anything moves."""
    from streamwise.runtime.hosts.dispatch import DispatchError, dispatch

    path, policy = _saved(tmp_path, "safetensors")
    expected, _ = _logits_and_tokens(streamwise.load_pretrained(path, policy, progress=False).model)
    model = streamwise.load_pretrained(path, policy, progress=False).model
    report = dispatch(model, "decoder-llm", max_memory={"cpu": 96 << 10, "disk": "1TB"})
    assert report.bytes["cpu"] <= 96 << 10 and report.bytes["disk"] > 0 and "disk" in model.hf_device_map.values()
    assert any(file_tier.on_file_tier(m, "weight") for m in model.modules())
    assert torch.equal(_logits_and_tokens(model)[0], expected)
    report = dispatch(model, "decoder-llm", max_memory={"cpu": "1GiB"})
    assert "disk" not in report.bytes and not any(file_tier.on_file_tier(m, "weight") for m in model.modules())
    assert torch.equal(_logits_and_tokens(model)[0], expected)
    torch.manual_seed(0)
    built = tiny_qwen2(tie_word_embeddings=False)
    before = {name: t.clone() for name, t in built.state_dict().items()}
    with pytest.raises(DispatchError, match="was not loaded from a file"):
        dispatch(built, "decoder-llm", max_memory={"cpu": 96 << 10, "disk": "1TB"})
    assert all(torch.equal(t, before[name]) for name, t in built.state_dict().items())


def test_a_budget_that_cannot_hold_what_must_be_in_memory_is_refused_with_its_figures(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    with pytest.raises(CheckpointError) as raised:
        streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 4096})
    message = str(raised.value)
    assert str(path / "model.safetensors") in message
    assert "loading needs at least" in message and "the host budget is 4.0 KiB, as given (max_memory['cpu'])" in message
    assert "staging buffer of the largest unit" in message and "raise the host budget" in message


def test_memory_too_short_for_two_staging_buffers_reads_with_one_and_no_read_ahead(tmp_path, monkeypatch):
    """One staging buffer then serves every read: each unit's read waits for nothing, since the unit before is done
    with it (a read taking a buffer outside the pool would exceed the budget the load counted)."""
    path, policy = _saved(tmp_path, "safetensors")
    expected, _ = _logits_and_tokens(streamwise.load_pretrained(path, policy, progress=False).model)
    largest = 128 * 64 * 4  # the float32 embedding and output head
    tight = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": largest + largest // 2})
    tiers = tight.report.tiers
    assert tiers.slabs == 1 and tiers.staging_bytes == largest and "no read-ahead" in str(tight.report)
    taken, buffer = [], file_reads.FileTier._buffer
    monkeypatch.setattr(file_reads.FileTier, "_buffer", lambda self, nbytes, *, pooled, **rest: (
        taken.append(pooled), buffer(self, nbytes, pooled=pooled, **rest))[1])
    assert torch.equal(_logits_and_tokens(tight.model)[0], expected)
    assert taken and all(taken), "a read took a buffer outside the pool"


def test_the_split_leaving_the_fewest_bytes_in_the_file_is_taken():
    """Staging is sized for the largest unit left in the file: keeping one large unit in memory can leave far
    less of the rest in the file than streaming it would."""
    from streamwise.runtime.checkpoint import tiers

    def unit(path, size):
        return tiers.Unit(path, [(path, torch.empty(size, dtype=torch.uint8, device="meta"))])

    units = [unit("embed", 1000), *(unit(f"layer{i}", 100) for i in range(10)), unit("head", 1000)]
    for unit_ in units:  # as read from a file: each may stay there
        unit_.values[:] = [(key, _source(value.numel())) for key, value in unit_.values]
    placed = tiers.place("model", [], units, tiers.HostBudget(2600, "a test's"))
    assert placed.in_file == frozenset(f"layer{i}" for i in range(4, 10))  # not the embedding and head
    assert (placed.host_bytes, placed.file_bytes, placed.staging_bytes) == (2400, 600, 200)


def _source(nbytes: int):
    figures = dict(file=None, offset=0, dtype=torch.uint8, shape=(nbytes,), nbytes=nbytes)  # nothing is read here
    return file_tier.FileSource(type("Range", (), figures)(), torch.uint8, (nbytes,))


def test_a_budget_larger_than_the_memory_there_is_is_held_to_what_can_be_spared(tmp_path, monkeypatch):
    """A budget is a most: past what the process can allocate it would end in the OOM killer."""
    from streamwise.runtime import host_memory
    from streamwise.runtime.checkpoint import tiers

    path, policy = _saved(tmp_path, "safetensors")
    monkeypatch.setattr(tiers, "host_memory", lambda: host_memory.HostMemory(200 << 10, 1 << 20, "a test's figure"))
    loaded = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": "1GiB"})
    assert loaded.report.tiers.budget == (200 << 10) - (1 << 20) // 10 and loaded.report.tiers.file_bytes > 0


def test_short_of_memory_an_auto_budget_leaves_only_the_forwards_room_with_everything_it_can_in_the_file(
        tmp_path, monkeypatch):
    """Where 10% of the ceiling leaves too little for what must be in memory, `auto` keeps `SHORT_MARGIN` free and
    every unit that can stay in the file there, so that what is left is the forward's; below that, refused."""
    from streamwise.runtime import host_memory
    from streamwise.runtime.checkpoint import tiers

    path, policy = _saved(tmp_path, "safetensors")
    expected, _ = _logits_and_tokens(streamwise.load_pretrained(path, policy, progress=False).model)
    ceiling = 2 << 30  # 10% of it: more than what is available
    available = tiers.SHORT_MARGIN + (96 << 10)
    monkeypatch.setattr(tiers, "host_memory", lambda: host_memory.HostMemory(available, ceiling, "a test's"))
    loaded = streamwise.load_pretrained(path, policy, progress=False)
    placed = loaded.report.tiers
    assert placed.budget == available - tiers.SHORT_MARGIN and placed.host_bytes < 1024  # the norms alone
    assert placed.file_units == sum(1 for m in loaded.model.modules() if file_tier.in_file(m))
    assert torch.equal(_logits_and_tokens(loaded.model)[0], expected)
    available = tiers.SHORT_MARGIN + (8 << 10)
    margin = re.escape(human(tiers.SHORT_MARGIN))
    with pytest.raises(tiers.HostBudgetError, match=rf"host budget is 8\.0 KiB: .* less {margin}, short of memory "
                                                      r"\(a test's\)"):
        streamwise.load_pretrained(path, policy, progress=False)


def test_revert_refuses_a_tree_whose_weights_are_in_their_file(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    with pytest.raises(ConversionError, match="left in their file"):
        streamwise.revert(model)
    assert streamwise.runtime.convert.applied_state(model) is not None  # still converted, still computing


def test_without_the_file_tier_everything_is_in_memory_or_the_load_is_refused(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    with pytest.raises(CheckpointError, match="of streamed units this host keeps in memory"):
        streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}, file_tier=False)
    loaded = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": "64MiB"}, file_tier=False)
    assert loaded.report.tiers.file_bytes == 0 and not any(file_tier.in_file(m) for m in loaded.model.modules())


def test_a_bad_host_budget_is_a_clear_error(tmp_path):
    path, policy = _saved(tmp_path, "safetensors")
    with pytest.raises(CheckpointError, match=r"max_memory\['cpu'\]='lots'"):
        streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": "lots"})


def test_a_staging_buffer_is_reused_only_once_nothing_holds_what_was_read_into_it(tmp_path):
    """A weight kept past its forward (by model code, by autograd) keeps its values while later units are read."""
    path, policy = _saved(tmp_path, "safetensors")
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    whole = streamwise.load_pretrained(path, policy, progress=False).model
    leaves = [(name, m) for name, m in model.named_modules() if file_tier.on_file_tier(m, "weight")]
    assert len(leaves) > file_reads.FileTier.SLABS + 1
    kept = file_tier.held(leaves[0][1], "weight")
    for _, module in leaves[1:]:
        file_tier.held(module, "weight")
    assert torch.equal(kept, whole.get_submodule(leaves[0][0]).weight)


def test_reads_run_ahead_of_the_forward_as_far_as_the_staging_pool_allows(tmp_path, monkeypatch):
    """After the first forward (the order learnt), the units that follow are read on the reader thread, several
    at once where they fit the pool, and the pool never holds more than `slabs` times the largest unit."""
    path, policy = _saved(tmp_path, "safetensors")
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    tier = streamwise.runtime.convert.applied_state(model).tree.file_tier
    largest = max(file_reads._unit_bytes(m) for m in model.modules())
    _logits_and_tokens(model)  # learns the order
    threads, ahead = [], []
    read_into = type(next(s for m in model.modules() for s in file_tier.sources(m).values()).range.file).read_into

    def recorded(self, ranges, **options):
        threads.append(threading.current_thread().name)
        return read_into(self, ranges, **options)

    monkeypatch.setattr(type(next(s for m in model.modules() for s in file_tier.sources(m).values()).range.file),
                        "read_into", recorded)
    original_read = tier.read
    monkeypatch.setattr(tier, "read", lambda module: (original_read(module), ahead.append(len(tier._ahead)))[0])
    with torch.no_grad():
        model(INPUTS)
    assert threads and sum(name.startswith("streamwise-read-ahead") for name in threads) >= len(threads) // 2
    assert max(ahead) >= 2, ahead
    assert tier.staging_bytes <= tier.slabs * largest


def test_the_kernel_is_asked_to_read_the_units_past_the_staging_pool_before_they_are_needed(tmp_path, monkeypatch):
    """Where the pool is full, the next units in the forward's order are advised to the kernel
    (`POSIX_FADV_WILLNEED`, their own ranges, as many bytes as the pool holds): reads in flight beside the reader
    thread's, each once until it is read; and those units are then read as any other."""
    path, policy = _saved(tmp_path, "safetensors")
    model = streamwise.load_pretrained(path, policy, progress=False, max_memory={"cpu": 64 << 10}).model
    expected, _ = _logits_and_tokens(model)  # learns the order
    checked = type(next(s for m in model.modules() for s in file_tier.sources(m).values()).range.file)
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(checked, "advise", lambda self, spans: advised.extend(spans))
    with torch.no_grad():
        logits = model(INPUTS).logits
    in_file = {(s.range.offset, s.range.nbytes) for m in model.modules() if file_tier.in_file(m)
               for name, s in file_tier.sources(m).items() if file_tier.on_file_tier(m, name)}
    assert advised and set(advised) <= in_file
    assert len(advised) == len(set(advised))  # a unit is advised once until it is read, not again at every fetch
    assert torch.equal(logits, expected)


CHILD = textwrap.dedent('''
    import json, os, sys, threading, time
    import torch, streamwise

    def anon():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

    folder, budget = sys.argv[1], sys.argv[2]
    import transformers  # the import baseline: what the interpreter, torch, transformers and the model's code hold
    from transformers import Qwen2ForCausalLM
    from streamwise.runtime.checkpoint import pretrained
    with torch.no_grad():  # torch's own first-use allocations (thread pools) belong to the baseline too
        torch.nn.functional.linear(torch.ones(64, 64), torch.ones(64, 64))
    if folder.endswith(".gguf"):  # and a GGUF's CPU kernels (numba's, where installed): a load takes them first
        from streamwise.runtime.quant import gguf_dequant
        gguf_dequant.prepare(torch.device("cpu"))
    base, peak, done = anon(), [0], threading.Event()
    if budget == "imports":
        print(json.dumps({"anon": base}))
        sys.exit(0)

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    max_memory = None if budget == "auto" else {"cpu": int(budget)}
    model, report, _ = streamwise.load_pretrained(folder, "auto", progress=False, max_memory=max_memory)
    with torch.no_grad():
        tokens = model.generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=4, do_sample=False)[0].tolist()
    done.set()
    sampler.join()
    print(json.dumps({"tokens": tokens, "grown": max(peak[0], anon()) - base, "base": base,
                      "file": report.tiers.file_bytes,
                      "host": report.tiers.host_bytes, "staging": report.tiers.staging_bytes}))
''')


def _saved_model(folder: Path, hidden: int, layers: int) -> int:
    """A float32 Qwen2 saved by transformers; its file's size."""
    torch.manual_seed(0)
    model = tiny_qwen2(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, vocab_size=2048,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    model.save_pretrained(folder)
    return (folder / "model.safetensors").stat().st_size


def _child(folder: Path, budget: str, cgroup: MemoryCgroup | None = None, *, lease: bool = True) -> dict:
    result = _run_child(folder, budget, cgroup, lease=lease)
    assert result.returncode == 0, f"exit code {result.returncode} (-9: killed by the kernel): {result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _run_child(folder: Path, budget: str, cgroup: MemoryCgroup | None = None, *,
               lease: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", CHILD, str(folder), budget]
    if cgroup is not None:
        command = cgroup.command(command)
    environment = {**os.environ, "STREAMWISE_LEASE": "1" if lease else "0"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO / "tests", env=environment)


#: The least headroom where transformers' `from_pretrained` + `generate` ran on the folder of the test below, above
#: its imports (the modeling code included), tied and untied: thrashing there (138-400 s for 8 tokens, against 45 s
#: with 32 MiB), out of time with 16 (`benchmarks/bench_headroom.py`, `benchmarks/results/headroom-2026-12-06.md`).
TRANSFORMERS_ROOM = 24 << 20


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_a_model_whose_embedding_is_a_fifth_of_its_bytes_runs_in_the_room_transformers_needs(tmp_path, variant):
    """A float32 Qwen2 with a 32,000-token vocabulary (its 125 MiB embedding a fifth of the untied model's bytes,
    shared with the head where tied) under a memory cgroup leaving it transformers' room above the imports: the
    embedding and head stay in the file, read by rows, and the tokens are those of an unlimited run. With 8 MiB above
    the imports, never the OOM killer: the clear refusal, or, where the cgroup's reclaimable page cache leaves the
    budget room for a staging buffer (its state is the machine's, not the test's), the same tokens again."""
    with memory_cgroup() as cgroup:
        torch.manual_seed(0)
        tiny_qwen2(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=variant == "tied"
                   ).save_pretrained(tmp_path)
        size = (tmp_path / "model.safetensors").stat().st_size
        expected = _child(tmp_path, str(size * 4))
        imports = _child(tmp_path, "imports", cgroup)["anon"]  # its libraries' page cache stays charged to the cgroup
        cgroup.limit(cgroup.usage() + imports + TRANSFORMERS_ROOM)
        limited = _child(tmp_path, "auto", cgroup)
        assert limited["tokens"] == expected["tokens"] and limited["file"] > size * 9 // 10, limited
        cgroup.limit(cgroup.usage() + imports + (8 << 20))
        short = _run_child(tmp_path, "auto", cgroup)
        if short.returncode == 0:
            assert json.loads(short.stdout.strip().splitlines()[-1])["tokens"] == expected["tokens"], short.stdout
        else:
            assert short.returncode == 1 and "loading needs at least" in short.stderr, short.stderr[-3000:]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RssAnon is read from /proc (Linux)")
def test_the_anonymous_memory_of_a_load_stays_within_the_host_budget(tmp_path):
    """With private copies (leases off: Windows, a network file system), and with the host tier mapped under a
    lease, which holds it in the page cache instead of anonymous memory."""
    size = _saved_model(tmp_path, 256, 8)  # ~40 MiB: holding it would show beside the budget
    expected = _child(tmp_path, str(size * 4), lease=False)  # room for everything: the reference tokens
    budget = size // 5
    tight = _child(tmp_path, str(budget), lease=False)
    assert tight["tokens"] == expected["tokens"] and tight["file"] > size // 2, (tight, expected)
    # generous: the allocator's slack and the forward's activations come on top of the budget
    assert tight["grown"] <= budget + 16 * 2**20, (tight, expected)
    assert expected["grown"] >= size, expected  # the measure sees a whole model held in memory
    if leases_here(tmp_path):
        mapped = _child(tmp_path, str(size * 4))
        assert mapped["tokens"] == expected["tokens"] and mapped["file"] == 0, (mapped, expected)
        assert mapped["grown"] < size // 4, (mapped, expected)  # the weights are the file's page cache


@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_a_checkpoint_larger_than_the_memory_limit_runs_under_it(tmp_path, form):
    """Under a memory cgroup whose room above the imports is below the checkpoint's size, the default host budget
    (read from the cgroup) leaves what does not fit in the file, and the tokens are those of an unlimited run. The
    GGUF is what `streamwise quantize` writes (Q8_0, alone): its blocks stay quantized, read raw at each fetch, and
    expanded at each call (before the skeleton stopped leaving heap holes, killed about one run in three)."""
    with memory_cgroup() as cgroup:
        path, size = tmp_path, _saved_model(tmp_path, 1024, 12)  # ~740 MB
        room = 256 * 2**20
        if form == "gguf":
            from streamwise.runtime.cli.streamwise import main

            path = tmp_path / "model.Q8_0.gguf"
            assert main(["quantize", str(tmp_path), str(path), "--type", "Q8_0"]) == 0
            size, room = path.stat().st_size, 96 * 2**20  # ~200 MB
        assert room < size  # the checkpoint cannot be held whole beside the imports
        expected = _child(path, str(size * 4))
        # run in the cgroup, so the page cache its libraries are read through stays charged there (a CUDA build's
        # are larger than the CPU build's by hundreds of MiB): the room is above both, whichever build runs
        imports = _child(path, "imports", cgroup)["anon"]
        cgroup.limit(cgroup.usage() + imports + room)
        limited = _child(path, "auto", cgroup)
        assert limited["tokens"] == expected["tokens"] and limited["file"] > size // 2, limited
