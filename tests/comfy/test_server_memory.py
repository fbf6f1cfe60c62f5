"""A user short of memory: a real ComfyUI server inside a memory cgroup whose limit leaves the model only a quarter
of its size beyond what the idle server holds, or less than transformers needs beyond what a server that ran a
model holds. The loader's default host budget reads the limit, keeps what does not fit in the file, and Generate
Text gives transformers' text; a loader run again makes room with its previous model; the server is never killed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from helpers import memory_cgroup, module_from_file

server_module = module_from_file(Path(__file__).with_name("test_server.py"))


def _larger_model(models: Path) -> tuple[Path, int]:
    """A ~480 MiB Qwen2 beside the example model, with its tokenizer; its folder and the bytes of its weights."""
    import transformers

    tiny = models / "streamwise" / "tiny-qwen2"
    folder = models / "streamwise" / "larger-qwen2"
    known = json.loads((tiny / "config.json").read_text())
    config = transformers.Qwen2Config(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=known["vocab_size"], tie_word_embeddings=False,
        **{key: known.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    for path in tiny.iterdir():
        if not path.name.startswith(("model", "config")):
            shutil.copy(path, folder / path.name)
    return folder, sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def test_a_model_larger_than_the_memory_left_generates_under_the_limit(comfy_root, tmp_path):
    with memory_cgroup() as cgroup:
        base = tmp_path / "base"
        base.mkdir()
        paths = server_module.prepared(comfy_root, base)
        folder, size = _larger_model(base / "models")
        graph = server_module.workflow("streamwise_generate_text")
        graph["1"]["inputs"]["model"] = "streamwise/larger-qwen2"
        expected = server_module.expected_text(folder, graph)
        with server_module.launched(comfy_root, base, paths, preexec_fn=cgroup.enter) as server:
            limit = cgroup.usage() + size // 4  # the idle server, and a quarter of the model
            cgroup.limit(limit)
            entry = server.wait(server.queue(graph), timeout=300)
            killed = server.process.poll()
            assert killed is None, f"the server was killed ({killed})\n{server.tail()}"
            assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-3000:]
            assert entry["outputs"]["2"]["text"] == [expected]
            (report,) = entry["outputs"]["1"]["text"]
            assert ", file " in report, report  # most of it stayed in the file


def fifth_embedding_model(models: Path, tied: bool = True) -> Path:
    """A float32 Qwen2 whose 125 MiB embedding is a fifth of its 594 MiB, or (tied, as Qwen2-0.5B is: shared with
    its head) a quarter of its 469 MiB; a word-level tokenizer naming each of its 32,000 ids, with the example's
    ChatML template. `benchmarks/bench_headroom.py` loads it in its server trials."""
    import transformers
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models

    from streamwise.runtime.cli.example_models import CHAT_TEMPLATE, CORPUS

    folder = models / "streamwise" / ("fifth-qwen2" if tied else "fifth-qwen2-untied")
    words = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>", *dict.fromkeys(" ".join(CORPUS).split())]
    words += [f"w{index}" for index in range(32000 - len(words))]
    backend = Tokenizer(tokenizer_models.WordLevel({word: index for index, word in enumerate(words)},
                                                   unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                                     eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                                     additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    config = transformers.Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                      tie_word_embeddings=tied, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


#: Room above an idle server (its imports and the modeling code) where transformers' own `from_pretrained` +
#: `generate` of the fifth-embedding model ran, its tokenizer and chat template read in the run too: killed or out of
#: time with 16 to 28 MiB (`benchmarks/bench_headroom.py --server`, `benchmarks/results/headroom_server-2026-12-06.md`).
ROOM = 32 << 20


def _evicted(folder: Path) -> None:
    """The model's file out of the page cache: the cgroup's usage is then what the server holds."""
    for path in folder.glob("*.safetensors"):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def test_a_loader_run_again_makes_room_with_its_previous_model_and_runs_in_the_room_transformers_needs(
        comfy_root, tmp_path):
    """The fifth-embedding model loaded whole, then a limit leaving 12 MiB beyond the server's use: the loader run
    again with another `host_budget` is refused only until its previous model gives its memory back (its weights
    back to their file), then runs. With transformers' room beyond what the server then holds, it runs again, all of
    it read from the file; with 4 MiB, the clear refusal. Transformers' text each time, and the server alive. The
    older core lets the previous model go before the loader runs again: each run has its memory, and runs."""
    with memory_cgroup() as cgroup:
        base = tmp_path / "base"
        base.mkdir()
        paths = server_module.prepared(comfy_root, base)
        folder = fifth_embedding_model(base / "models")
        graph = server_module.workflow("streamwise_generate_text")
        graph["1"]["inputs"]["model"] = "streamwise/fifth-qwen2"
        expected = server_module.expected_text(folder, graph)
        assert expected.strip()  # words, not nothing

        def run(host_budget: str, room: int) -> dict:
            _evicted(folder)
            cgroup.limit(cgroup.usage() + room)
            graph["1"]["inputs"]["host_budget"] = host_budget  # another input: the loader runs again
            entry = server.wait(server.queue(graph), timeout=600)
            assert server.process.poll() is None, f"the server was killed\n{server.tail()}"
            return entry

        with server_module.launched(comfy_root, base, paths, preexec_fn=cgroup.enter) as server:
            _evicted(folder)  # read by the server: charged to its cgroup (v1 charges a page to its first reader)
            first = server.run(graph)  # no limit yet: loaded whole
            assert first["outputs"]["2"]["text"] == [expected] and ", file " not in first["outputs"]["1"]["text"][0]
            for host_budget, room in (("64GiB", 12 << 20), ("auto", ROOM)):
                entry = run(host_budget, room)
                assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-3000:]
                assert entry["outputs"]["2"]["text"] == [expected]
            log = (base / "server.log").read_text(errors="replace")
            last = run("8GiB", 4 << 20)
            if "Using RAM pressure cache" in log:  # v0.33 holds the previous model while its loader runs again
                assert "its previous model gave" in log and ", file 469.1 MiB" in entry["outputs"]["1"]["text"][0]
                (error,) = [data for kind, data in last["status"]["messages"] if kind == "execution_error"]
                assert error["node_type"] == "StreamwiseModelLoader" and "loading needs at least" in error[
                    "exception_message"], error
            else:  # the older core lets it go first: its memory is the next load's, nothing to give back or refuse
                assert "its previous model gave" not in log and last["outputs"]["2"]["text"] == [expected]
