"""A read the system refuses (EIO from a failing disk, another `OSError` from a network file system gone) while a
model loads or reads its file tier: a `CheckpointError` naming the file, the byte offset and the tensor, saying the
read failed, not that the file changed; and once reads succeed again the model computes the same numbers. The errors
are injected through the one function every read of a tensor's bytes goes through (`checked_file.read_at`), in the
forward's own thread and in the read-ahead threads. Plant tried: the `OSError` let through unconverted (each fails)."""

from __future__ import annotations

import errno
import os
import re
import threading

import pytest
import torch

import streamwise
from streamwise.runtime.checkpoint import checked_file
from streamwise.runtime.checkpoint.readers import CheckpointError
from streamwise.runtime.convert import applied_state

from helpers import logits

ERRORS = {"EIO": OSError(errno.EIO, os.strerror(errno.EIO)),
          "ENOTCONN": OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN))}  # a FUSE or network mount gone


def _failing_reads(monkeypatch, error: OSError, where=lambda: True) -> list[str]:
    """Every read of a tensor's bytes raises `error` where `where()` says so; the threads that failed, recorded."""
    failed, read_at = [], checked_file.read_at

    def failing(handle, view, offset):
        if where():
            failed.append(threading.current_thread().name)
            raise error
        return read_at(handle, view, offset)

    monkeypatch.setattr(checked_file, "read_at", failing)
    return failed


def _assert_names_the_failed_read(raised: CheckpointError, qwen2_folder, error: OSError) -> None:
    message = str(raised.value)
    assert str(qwen2_folder / "model.safetensors") in message and os.strerror(error.errno) in message, message
    assert re.search(r"tensor `[^`]+`: reading \d+ bytes at byte \d+ failed", message), message
    assert "did not change" in message and "changed after its header" not in message, message


@pytest.mark.parametrize("name", ERRORS)
def test_a_failing_read_in_the_forward_names_file_offset_and_tensor_and_the_model_recovers(qwen2_folder, monkeypatch,
                                                                                            name):
    model = streamwise.load_pretrained(qwen2_folder, "auto", progress=False, max_memory={"cpu": 64 << 10}).model
    applied_state(model).tree.file_tier.read_ahead = False  # every read in the forward's own thread
    expected = logits(model)
    with monkeypatch.context() as patched:
        failed = _failing_reads(patched, ERRORS[name])
        with pytest.raises(CheckpointError) as raised:
            logits(model)
    assert failed == [threading.current_thread().name]
    _assert_names_the_failed_read(raised, qwen2_folder, ERRORS[name])
    assert torch.equal(logits(model), expected)


@pytest.mark.parametrize("name", ERRORS)
def test_a_failing_read_ahead_names_file_offset_and_tensor_and_the_model_recovers(qwen2_folder, monkeypatch, name):
    model = streamwise.load_pretrained(qwen2_folder, "auto", progress=False, max_memory={"cpu": 64 << 10}).model
    expected = logits(model)  # learns the order: the next forward reads ahead
    with monkeypatch.context() as patched:
        failed = _failing_reads(patched, ERRORS[name],
                                lambda: threading.current_thread().name.startswith("streamwise-read-ahead"))
        with pytest.raises(CheckpointError) as raised:
            logits(model)
    assert failed and all(thread.startswith("streamwise-read-ahead") for thread in failed), failed
    _assert_names_the_failed_read(raised, qwen2_folder, ERRORS[name])
    assert torch.equal(logits(model), expected)


def test_a_failing_read_while_loading_names_file_offset_and_tensor_and_a_later_load_succeeds(qwen2_folder, monkeypatch):
    """Copied (no lease), as on Windows or a network file system, where the load reads every host-tier tensor."""
    monkeypatch.setenv("STREAMWISE_LEASE", "0")
    with monkeypatch.context() as patched:
        _failing_reads(patched, ERRORS["EIO"])
        with pytest.raises(CheckpointError) as raised:
            streamwise.load_pretrained(qwen2_folder, "auto", progress=False)
    _assert_names_the_failed_read(raised, qwen2_folder, ERRORS["EIO"])
    model = streamwise.load_pretrained(qwen2_folder, "auto", progress=False).model
    assert torch.isfinite(logits(model)).all()


def test_a_failing_read_of_a_gguf_tensor_names_it(qwen2_folder, monkeypatch):
    """The GGUF reader names its tensors' bytes too (its header's offsets)."""
    from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
    from streamwise.runtime.checkpoint.readers import open_checkpoint

    from helpers import gguf_policy

    path = qwen2_folder / "model.gguf"
    model = streamwise.load_pretrained(qwen2_folder, "auto", progress=False).model
    quantize_to_gguf(qwen2_folder / "model.safetensors", path, gguf_policy(qwen2_folder, "Q8_0"), model)
    checkpoint = open_checkpoint(path)
    name, stored = next((name, stored) for name, stored in checkpoint.tensors.items() if stored.qtype is not None)
    _failing_reads(monkeypatch, ERRORS["EIO"])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: tensor `{re.escape(name)}`: reading \d+ "
                                              r"bytes at byte \d+ failed \(Input/output error, errno 5\)"):
        stored.read()
