"""Every platform ComfyUI users run: with the Unix-only APIs taken away as on Windows (`os.O_NONBLOCK`,
`os.memfd_create`, `os.posix_fadvise`, `os.sysconf`, the `resource` and `fcntl` modules (so no read leases), and
every `/proc`, `/dev/fd` and cgroup path), the loads (safetensors, sharded, GGUF written by `streamwise quantize`, a
llama.cpp GGUF alone and its tokenizer), the quantize command and the demo run, and give exactly the numbers they give
with those APIs present.
"""

from __future__ import annotations

import builtins
import importlib
import io
import os
import stat
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
import torch

import streamwise
from streamwise.runtime import host_memory
from streamwise.runtime.checkpoint import checked_file, leased, llama_cpp, load_tokenizer
from streamwise.runtime.checkpoint.checked_file import CheckedFile
from streamwise.runtime.convert import applied_state
from streamwise.runtime.hosts import standalone

from helpers import gguf_policy, tiny_qwen2
from llama_cpp_files import CORPUS, float_model, train_tokenizer_parts, write_llama_cpp_gguf

transformers = pytest.importorskip("transformers")
try:  # psutil's Linux backend imports `resource` (its Windows one does not): loaded before it is taken away
    import psutil  # noqa: F401
except ImportError:
    pass

UNIX_ONLY = ("O_NONBLOCK", "memfd_create", "MFD_CLOEXEC", "posix_fadvise", "POSIX_FADV_DONTNEED",
             "POSIX_FADV_WILLNEED", "sysconf")
UNIX_PATHS = ("/proc", "/dev/fd", "/sys/fs/cgroup")


def _unix_path(path) -> bool:
    if isinstance(path, int):
        return False
    try:
        text = os.fsdecode(path)
    except TypeError:
        return False
    return any(text == prefix or text.startswith(prefix + "/") for prefix in UNIX_PATHS)


def _from_psutil() -> bool:
    """Whether psutil is the caller: it stands for the OS's own counts (Win32 calls on Windows), and its Linux
    backend reads /proc to give them."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("psutil"):
            return True
        frame = frame.f_back
    return False


def _refusing(original):
    """`original` (open or stat), with the Unix-only paths not there (but to psutil)."""

    def call(path, *args, **kwargs):
        if _unix_path(path) and not _from_psutil():
            raise FileNotFoundError(2, "not on this platform", os.fsdecode(path))
        return original(path, *args, **kwargs)

    return call


class _OsWithoutUnixOnly(types.ModuleType):
    """`os` as the project's modules see it on Windows: the Unix-only names missing, the rest the real module's
    (Python 3.13's own `shutil.rmtree` uses `os.O_NONBLOCK` on Linux: taking it from `os` itself would break the
    standard library, not simulate the platform)."""

    def __getattr__(self, name: str):
        if name in UNIX_ONLY:
            raise AttributeError(f"module 'os' has no attribute {name!r}")
        return getattr(os, name)


_WITHOUT_UNIX_ONLY = _OsWithoutUnixOnly("os")


@contextmanager
def windows_like():
    """The Unix-only APIs taken away; yields the paths every private header copy handed out meanwhile."""
    copies: list[str] = []
    copy = CheckedFile.private_copy

    @contextmanager
    def recorded(self, head):
        with copy(self, head) as path:
            copies.append(path)
            yield path

    with pytest.MonkeyPatch.context() as patch:
        for module in [module for name, module in sys.modules.items() if name.startswith("streamwise.")]:
            if getattr(module, "os", None) is os:  # the project's calls only: the standard library keeps its own
                patch.setattr(module, "os", _WITHOUT_UNIX_ONLY)
        patch.setattr(checked_file, "_FADVISE", None)  # captured at import
        patch.setattr(leased, "fcntl", None)  # Windows has no `fcntl`: no leases, private copies
        patch.setitem(sys.modules, "resource", None)  # `import resource` is an ImportError
        for module, name in ((os, "open"), (os, "stat"), (builtins, "open"), (io, "open")):
            patch.setattr(module, name, _refusing(getattr(module, name)))
        patch.setattr(CheckedFile, "private_copy", recorded)
        llama_cpp._parsed_metadata.cache_clear()  # a parse made with the APIs present would skip the copy
        try:
            yield copies
        finally:
            llama_cpp._parsed_metadata.cache_clear()
    assert all(not os.path.exists(path) and not os.path.exists(os.path.dirname(path)) for path in copies)


def test_the_fixture_takes_the_apis_away():
    with windows_like():
        assert not hasattr(checked_file.os, "O_NONBLOCK") and not hasattr(checked_file.os, "memfd_create")
        assert checked_file._FADVISE is None and host_memory.os is standalone.os is _WITHOUT_UNIX_ONLY
        assert hasattr(os, "O_NONBLOCK") or os.name == "nt"  # the standard library's own `os` is left whole
        with pytest.raises(ImportError):
            import resource  # noqa: F401
        assert not os.path.exists("/proc/self/fd") and not os.path.isdir("/dev/fd")
        with pytest.raises(FileNotFoundError):
            open("/proc/self/status")


def _gguf_file(path: Path) -> int:
    """A small GGUF (a header, then 1 MiB of tensor data); returns where its tensor data starts."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blob", torch.arange(1 << 18, dtype=torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path).tensors[0].data_offset


@pytest.mark.parametrize("where", ["windows", "linux without /proc"])
def test_the_private_copy_is_the_header_in_a_private_folder_of_the_file_size_and_gone_after(tmp_path, monkeypatch,
                                                                                            where):
    path = tmp_path / "model.gguf"
    head = _gguf_file(path)
    data = path.read_bytes()
    if where == "linux without /proc":  # memfd_create may be there; the descriptor cannot be named by a path
        monkeypatch.setattr(checked_file, "_PROC_FD", str(tmp_path / "no-proc"))
    with open(path, "rb") as handle:
        checked = CheckedFile(path, handle)
    with windows_like() if where == "windows" else monkeypatch.context(), checked.private_copy(head) as copy:
        assert os.path.basename(copy) == "header.gguf" and not copy.startswith(("/proc", "/dev"))
        folder = os.path.dirname(copy)
        if os.name == "posix":
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert os.listdir(folder) == ["header.gguf"]  # the reader's folder lookups find nothing else
        copied = Path(copy).read_bytes()
        assert len(copied) == len(data) == checked.size
        assert copied[:head] == data[:head] and copied[head:] == bytes(len(data) - head)
        assert len(gguf.GGUFReader(copy).tensors) == 1  # a mapping reader reads it as the file
    assert not os.path.exists(copy) and not os.path.exists(folder)


@pytest.mark.skipif(not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"), reason="Linux only")
def test_where_memfd_and_proc_are_there_the_copy_costs_no_disk(tmp_path):
    path = tmp_path / "model.gguf"
    head = _gguf_file(path)
    with open(path, "rb") as handle:
        checked = CheckedFile(path, handle)
    with checked.private_copy(head) as copy:
        assert copy.startswith("/proc/self/fd/") and os.path.getsize(copy) == checked.size
        assert Path(copy).read_bytes()[:head] == path.read_bytes()[:head]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 17, 42, 99, 7]])).logits


@pytest.mark.parametrize("layout", ["single file", "sharded"])
def test_a_safetensors_folder_loads_the_same(tmp_path, layout):
    torch.manual_seed(0)
    source = tiny_qwen2()
    source.save_pretrained(tmp_path, **({"max_shard_size": "40KB"} if layout == "sharded" else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == (layout == "sharded")
    with windows_like():
        stripped = _logits(streamwise.load_pretrained(tmp_path, "auto", progress=False).model)
    present = _logits(streamwise.load_pretrained(tmp_path, "auto", progress=False).model)
    assert torch.equal(stripped, present) and torch.equal(present, _logits(source))


def test_streamwise_quantize_writes_the_same_gguf_and_it_loads_the_same(tmp_path):
    from streamwise.runtime.cli.streamwise import main

    torch.manual_seed(0)
    tiny_qwen2().save_pretrained(tmp_path)
    policy = str(gguf_policy(tmp_path, "Q8_0"))
    with windows_like():
        assert main(["quantize", str(tmp_path), str(tmp_path / "stripped.gguf"), "--policy", policy]) == 0
        model, report, _ = streamwise.load_pretrained(tmp_path / "stripped.gguf", policy, progress=False)
        stripped = _logits(model)
    assert report.residents == {"gguf": 15}
    assert main(["quantize", str(tmp_path), str(tmp_path / "present.gguf"), "--policy", policy]) == 0
    assert (tmp_path / "stripped.gguf").read_bytes() == (tmp_path / "present.gguf").read_bytes()
    present = _logits(streamwise.load_pretrained(tmp_path / "present.gguf", policy, progress=False).model)
    assert torch.equal(stripped, present)


def test_a_llama_cpp_gguf_alone_and_its_tokenizer_load_the_same(tmp_path):
    """No config.json beside it: the config, the name map and the tokenizer all come through the header copy."""
    parts = train_tokenizer_parts()
    tokens, _, eos = parts
    path = tmp_path / "tiny-llama.Q8_0.gguf"
    write_llama_cpp_gguf(float_model("llama", len(tokens), eos), path, "llama", gguf.GGMLQuantizationType.Q8_0, parts)
    ids = torch.tensor([[eos, 5, 17, 42, 99, 7]])
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=eos)

    def run():
        model = streamwise.load_pretrained(path, "auto", progress=False).model
        tokenizer = load_tokenizer(applied_state(model).source)
        with torch.no_grad():
            return model(ids).logits, model.generate(ids, **greedy), tokenizer(CORPUS[0])["input_ids"]

    with windows_like() as copies:
        stripped = run()
    assert copies and all(os.path.basename(copy) == "header.gguf" for copy in copies)
    present = run()
    assert torch.equal(stripped[0], present[0]) and torch.equal(stripped[1], present[1])
    assert stripped[2] == present[2] and len(stripped[2]) > 1


def test_the_demo_runs_and_reports_the_same_numbers(monkeypatch, capsys):
    from streamwise.runtime.cli import demo
    from streamwise.runtime.cli.streamwise import main

    seen = []
    with windows_like():
        importlib.reload(demo)  # its imports as on Windows, where there is no `resource`
        run_demo = demo.run_demo
        # kept short: one case (the LLM: safetensors, quantize, GGUF, generation; the other loads the same way),
        # and one timed call each, as timings are not compared
        monkeypatch.setattr(demo, "CASES", {"qwen2": demo.CASES["qwen2"]})
        monkeypatch.setattr(demo, "RUNS", 1)
        monkeypatch.setattr(demo, "run_demo", lambda: seen.append(run_demo()) or seen[-1])
        assert main(["demo"]) == 0
    printed = capsys.readouterr().out
    assert "16/16 greedy tokens agree" in printed
    assert "peak resident memory of this process: unknown on this platform" in printed  # psutil has no peak on Linux
    present = run_demo(print=lambda *args: None)
    stripped = seen[0]
    assert stripped.pop("peak_rss_mib") is None and present.pop("peak_rss_mib") > 0
    timings = ("seconds", "eager_seconds")
    assert ({k: {n: v for n, v in r.items() if n not in timings} for k, r in stripped.items()}
            == {k: {n: v for n, v in r.items() if n not in timings} for k, r in present.items()})
