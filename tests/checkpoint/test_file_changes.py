"""A file changed under a loaded model, or while it loads: the numbers never change and the process never dies.

Each case runs in a child interpreter, so a SIGBUS (what a memory-mapped checkpoint gave when truncated) fails the
test instead of killing the run. After a load the file is truncated, or rewritten in place with other values of the
same size, and the model must compute exactly what it computed before: through a lease on its page cache
(`checkpoint.leased`: the change waits while the watcher copies) and through private copies (`STREAMWISE_LEASE=0`,
as on Windows or a network file system). Between the header check and the tensor reads
the same changes must be a `CheckpointError` naming the file, with the model untouched. Files are written by the
real libraries: safetensors' `save_file`, the gguf package's writer (Streamwise's own layout), and llama.cpp's
converter layout through `tests/llama_cpp_files.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, leases_here

CHILD = textwrap.dedent('''
    import importlib, json, os, sys, time
    import torch, safetensors.torch
    import streamwise
    from streamwise.runtime.checkpoint import fill, leased, readers
    from streamwise.runtime.checkpoint.gguf_writer import quantize_to_gguf
    from helpers import make_policy, tiny_qwen2

    form, change, when, folder, tier = sys.argv[1:6]
    budget = 145 * 1024 if form == "llama_cpp" else 64 * 1024  # below the model: units stay in the file (llama.cpp:
    max_memory = {"cpu": budget} if tier == "file" else None  # the values transformers reorders, kept in memory)

    def damage(path):
        if change == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
        else:  # the same size, other values: a re-download of another version in place
            data = bytearray(open(path, "rb").read())
            start = len(data) // 2
            data[start:] = bytes(255 - b for b in data[start:])
            with open(path, "r+b") as handle:
                handle.write(data)

    def tiny():
        torch.manual_seed(0)
        return tiny_qwen2(hidden_size=32, intermediate_size=64, vocab_size=64)

    inputs = torch.arange(8).reshape(1, 8)
    source = tiny()
    if form == "safetensors":
        path = os.path.join(folder, "model.safetensors")
        safetensors.torch.save_file(source.state_dict(), path)
        policy, build = "decoder-llm", tiny
    elif form == "sharded":
        source.save_pretrained(folder, max_shard_size="20KB")
        path = os.path.join(folder, "model.safetensors.index.json")
        policy, build = "decoder-llm", tiny
    elif form == "gguf":
        safetensors.torch.save_file(source.state_dict(), os.path.join(folder, "src.safetensors"))
        path = os.path.join(folder, "model.gguf")
        quantize_to_gguf(os.path.join(folder, "src.safetensors"), path, make_policy(), source)  # F32, our layout
        policy, build = "decoder-llm", tiny
    else:  # llama.cpp's layout, built from its own metadata by load_pretrained
        from llama_cpp_files import float_model, train_tokenizer_parts, write_llama_cpp_gguf
        import gguf
        parts = train_tokenizer_parts()
        path = os.path.join(folder, "model.gguf")
        write_llama_cpp_gguf(float_model("llama", len(parts[0]), parts[2]), path, "llama",
                             gguf.GGMLQuantizationType.Q8_0, parts)

    def load():
        if form == "llama_cpp":
            model, report, _ = streamwise.load_pretrained(path, "auto", progress=False, max_memory=max_memory)
        else:
            with streamwise.skeleton():
                model = build()
            report = streamwise.load(model, path, policy, progress=False, max_memory=max_memory)
        assert (report.tiers.file_bytes > 0) == (tier == "file"), report
        return model

    if when == "after":
        model = load()
        with torch.no_grad():
            before = model(inputs).logits
        mapped = leased._WATCHER.leased  # bytes the host tier holds in the page cache, under a lease
        damage(path if form != "sharded" else os.path.join(folder, sorted(
            name for name in os.listdir(folder) if name.endswith(".safetensors"))[-1]))
        try:
            with torch.no_grad():
                after = model(inputs).logits
        except readers.CheckpointError as exc:
            print(json.dumps({"error": str(exc), "mapped": mapped}))
        else:
            print(json.dumps({"same": bool(torch.equal(before, after)), "mapped": mapped}))
    else:  # between the header check and the tensor reads (llama.cpp: also before transformers reads the header)
        opened = readers.open_checkpoint

        def open_then_damage(*args, **kwargs):
            checkpoint = opened(*args, **kwargs)
            time.sleep(0.02)  # past the file system's timestamp tick: a rewrite within one keeps the identity
            damage(path)
            return checkpoint

        for module in ("fill", "llama_cpp", "pretrained"):
            owner = importlib.import_module(f"streamwise.runtime.checkpoint.{module}")  # llama_cpp: GGUF alone
            setattr(owner, "open_checkpoint", open_then_damage)
        try:
            load()
        except readers.CheckpointError as exc:
            print(json.dumps({"error": str(exc)}))
        else:
            print(json.dumps({"error": None}))
''')


def run_child(tmp_path, form: str, change: str, when: str, tier: str = "host", lease: bool = True) -> dict:
    environment = {**os.environ, "STREAMWISE_LEASE": "1" if lease else "0"}
    result = subprocess.run([sys.executable, "-c", CHILD, form, change, when, str(tmp_path), tier],
                            capture_output=True, text=True, timeout=600, cwd=REPO / "tests", env=environment)
    assert result.returncode == 0, f"exit code {result.returncode} (-7 is SIGBUS): {result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


FORMS = ["safetensors", "gguf", "llama_cpp"]


@pytest.mark.parametrize("lease", [True, False], ids=["leased", "copied"])
@pytest.mark.parametrize("change", ["truncate", "rewrite"])
@pytest.mark.parametrize("form", FORMS)
def test_a_loaded_model_computes_the_same_whatever_happens_to_its_file(tmp_path, form, change, lease):
    if lease and not leases_here(tmp_path):
        pytest.skip(f"no read lease on {tmp_path}'s file system here: the loads copy (the `copied` case)")
    outcome = run_child(tmp_path, form, change, "after", lease=lease)
    assert outcome["same"] is True, outcome
    assert (outcome["mapped"] > 0) == lease, outcome  # the host tier really was the page cache, or really copies


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
@pytest.mark.parametrize("form", FORMS)
def test_a_file_changed_while_it_loads_is_an_error_naming_it(tmp_path, form, change):
    """The error says the file changed since its header was read, or (where a later step reads it afresh) that it is
    no longer a readable file."""
    error = run_child(tmp_path, form, change, "during")["error"]
    assert error is not None and str(tmp_path / f"model.{'safetensors' if form == 'safetensors' else 'gguf'}") in error
    assert "the file changed after its header was read" in error or "not a readable" in error, error


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
@pytest.mark.parametrize("form", ["safetensors", "sharded", "gguf", "llama_cpp"])
def test_a_file_changed_under_its_file_tier_is_an_error_naming_it_at_the_next_fetch(tmp_path, form, change):
    """Tensors left in the file are read at each forward: a changed file is a CheckpointError naming it then,
    never a signal and never other numbers."""
    outcome = run_child(tmp_path, form, change, "after", tier="file")
    error = outcome.get("error")
    assert error is not None, outcome
    assert str(tmp_path) in error and "the file changed after its header was read" in error, error
