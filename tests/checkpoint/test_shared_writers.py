"""A checkpoint a process maps shared and writable (`numpy.memmap(mode="r+")`, pages dirtied before the load): its
writes through the mapping change the bytes with no new modification time until written back, which the file tier's
identity check cannot see. A load that would leave units in such a file is refused, naming the file and the process;
once the mapping is gone the same load runs and computes what an unlimited one does; a writer through `write()`
(which stamps a new time at once) is not refused. Plant tried: the check removed from `tiers.place` (the refusal
test fails, and the load computes from bytes the mapping may change)."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import torch

import streamwise
from streamwise.runtime.checkpoint.readers import CheckpointError

from helpers import logits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and read leases: Linux")
BUDGET = {"cpu": 64 << 10}  # most units left in the file


def test_a_file_mapped_shared_and_writable_keeps_no_unit_and_the_load_says_who_maps_it(qwen2_folder):
    expected = logits(streamwise.load_pretrained(qwen2_folder, "auto", progress=False).model)
    path = qwen2_folder / "model.safetensors"
    mapped = np.memmap(path, mode="r+")
    mapped[-1] = mapped[-1]  # a page dirtied before the load, as an editor leaves it
    with pytest.raises(CheckpointError) as raised:
        streamwise.load_pretrained(qwen2_folder, "auto", progress=False, max_memory=BUDGET)
    message = str(raised.value)
    assert str(path) in message and f"process {os.getpid()}" in message, message
    assert "maps it shared and writable" in message and re.search(r"host budget of at least \d", message), message
    streamwise.load_pretrained(qwen2_folder, "auto", progress=False)  # everything in memory: nothing left in the file
    del mapped  # unmapped: the file tier may hold units of it again
    tight = streamwise.load_pretrained(qwen2_folder, "auto", progress=False, max_memory=BUDGET)
    assert tight.report.tiers.file_units > 0 and torch.equal(logits(tight.model), expected)


def test_a_writer_through_write_is_not_refused(qwen2_folder):
    """It stamps a new modification time with each write, which the file tier's check sees."""
    with open(qwen2_folder / "model.safetensors", "r+b"):
        tight = streamwise.load_pretrained(qwen2_folder, "auto", progress=False, max_memory=BUDGET)
    assert tight.report.tiers.file_units > 0


def test_another_process_mapping_the_file_for_writing_is_named(qwen2_folder):
    import subprocess

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, numpy as np\n"
        "mapped = np.memmap(sys.argv[1], mode='r+')\n"
        "mapped[-1] = mapped[-1]\n"
        "print('mapped', flush=True)\n"
        "sys.stdin.read()\n"), str(qwen2_folder / "model.safetensors")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        with pytest.raises(CheckpointError, match=f"process {holder.pid} "):
            streamwise.load_pretrained(qwen2_folder, "auto", progress=False, max_memory=BUDGET)
    finally:
        holder.communicate("", timeout=60)
