"""The host tier on the page cache under a read lease (`checkpoint.leased`): when it is taken, when it is given back,
and what the model computes meanwhile. Truncations and in-place rewrites under a leased model are
`test_file_changes.py`'s (in a child interpreter, so a SIGBUS would fail them)."""

from __future__ import annotations

import gc
import json
import os
import struct
import time

import pytest
import torch

import streamwise
from streamwise.runtime.checkpoint import leased
from streamwise.runtime.checkpoint.errors import CheckpointError
from streamwise.runtime.checkpoint.readers import open_checkpoint
from streamwise.runtime.checkpoint.tiers import read_in
from streamwise.runtime.engine.file_tier import FileSource

from helpers import leases_here, logits, tiny_qwen2


@pytest.fixture
def folder(tmp_path):
    if not leases_here(tmp_path):
        pytest.skip(f"no read lease on {tmp_path}'s file system here: loads copy (test_file_changes.py's `copied`)")
    torch.manual_seed(0)
    tiny_qwen2(hidden_size=64, intermediate_size=128, vocab_size=128).save_pretrained(tmp_path, max_shard_size="60KB")
    return tmp_path


def _shards(folder) -> list:
    return sorted(folder.glob("*.safetensors"))


def _mapped(paths) -> set[str]:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        text = maps.read()
    return {str(path) for path in paths if str(path) in text}


def _leased(folder) -> bool:
    return any(str(lease.path).startswith(str(folder)) for lease in list(leased._WATCHER.leases))


def _settled(condition, seconds: float = 10.0) -> bool:
    """`condition()` once it holds, waiting for the watcher's next looks (it polls every `POLL_SECONDS`)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(leased.POLL_SECONDS)
    return condition()


def test_every_shard_is_mapped_and_computes_what_a_copy_computes(folder, monkeypatch):
    shards = _shards(folder)
    assert len(shards) > 1
    mapped = streamwise.load_pretrained(folder, "auto", progress=False).model
    assert _mapped(shards) == {str(path) for path in shards}
    monkeypatch.setenv("STREAMWISE_LEASE", "0")
    copied = streamwise.load_pretrained(folder, "auto", progress=False).model
    assert torch.equal(logits(mapped), logits(copied))


def test_the_lease_is_given_back_when_the_model_is_gone(folder):
    model = streamwise.load_pretrained(folder, "auto", progress=False).model
    assert _leased(folder)
    del model
    gc.collect()
    assert _settled(lambda: not _leased(folder) and not _mapped(_shards(folder)))
    with open(_shards(folder)[0], "r+b"):  # no lease left to break: the writer is not held
        pass


def test_a_file_replaced_by_rename_keeps_serving_the_loaded_values(folder):
    """A rename puts another file at the path; the mapped one is unchanged underneath (nothing opened it to write),
    so nothing is copied and the numbers stay."""
    model = streamwise.load_pretrained(folder, "auto", progress=False).model
    before = logits(model)
    for path in _shards(folder):
        replacement = path.with_suffix(".new")
        replacement.write_bytes(bytes(path.stat().st_size))
        os.replace(replacement, path)
    assert torch.equal(logits(model), before)
    assert _leased(folder)  # still the old files' page cache


def test_a_file_someone_is_writing_is_copied_not_leased(folder, monkeypatch):
    shard = _shards(folder)[0]
    with open(shard, "r+b"):  # a writer holds it open: the kernel refuses the lease
        model = streamwise.load_pretrained(folder, "auto", progress=False).model
        assert _mapped(_shards(folder)) == {str(path) for path in _shards(folder)[1:]}
    monkeypatch.setenv("STREAMWISE_LEASE", "0")
    assert torch.equal(logits(model), logits(streamwise.load_pretrained(folder, "auto", progress=False).model))


def test_no_more_is_leased_than_the_watcher_can_copy_within_the_break_time(folder, monkeypatch):
    monkeypatch.setattr(leased, "_lease_cap", lambda: 0)
    model = streamwise.load_pretrained(folder, "auto", progress=False).model
    assert not _mapped(_shards(folder)) and not _leased(folder)
    assert torch.isfinite(logits(model)).all()


def test_a_file_changed_just_before_its_lease_is_refused_not_mapped(folder, monkeypatch):
    """A writer that opened, wrote and closed the file between the load's last check and its lease leaves nothing
    for the lease to refuse: the identity is checked again under the lease, and the load then copies, which names
    the changed file."""
    real = leased.fcntl

    class Damaging:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def fcntl(descriptor, command, argument=0):
            if command == real.F_SETLEASE and argument == real.F_RDLCK:
                shard = _shards(folder)[0]
                shard.write_bytes(bytes(reversed(shard.read_bytes())))
            return real.fcntl(descriptor, command, argument)

    monkeypatch.setattr(leased, "fcntl", Damaging())
    with pytest.raises(CheckpointError, match="the file changed after its header was read"):
        streamwise.load_pretrained(folder, "auto", progress=False)
    assert not _mapped(_shards(folder))


def test_a_tensor_off_its_dtype_alignment_is_copied_beside_mapped_ones(tmp_path):
    """An F16 tensor of odd length puts the next F32 tensor two bytes off its alignment (valid safetensors): a
    view of the mapping could not hold it as float32, so it is copied; the aligned one is mapped."""
    if not leases_here(tmp_path):
        pytest.skip(f"no read lease on {tmp_path}'s file system here")
    path = tmp_path / "odd.safetensors"
    header = json.dumps({"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}).encode()
    header += b" " * (-(8 + len(header)) % 8)  # the data starts 8-byte aligned: only `b` is off
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<e", 1.5) + struct.pack("<f", 2.5))
    stored = open_checkpoint(path).tensors
    a, b = read_in([FileSource(stored[key].read, stored[key].dtype, stored[key].shape) for key in "ab"],
                   drop_cache=False)
    assert (a.item(), b.item()) == (1.5, 2.5)
    assert all(tensor.data_ptr() % tensor.element_size() == 0 for tensor in (a, b))  # kernels may assume it
    assert _mapped([path]) == {str(path)}
