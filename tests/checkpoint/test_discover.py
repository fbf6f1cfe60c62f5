"""What model discovery (`checkpoint.discover`) offers the loader's picker: only what loads, symlinks followed, labels
never escape."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from streamwise.runtime.checkpoint import discover
from streamwise.runtime.checkpoint.weight_files import SHARD_INDEX

from helpers import tiny_qwen2


def model_folder(folder: Path, *weights: str) -> Path:
    """A folder with a config.json and placeholder weight files (listing never opens them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}), encoding="utf-8")
    for name in weights:
        (folder / name).write_bytes(b"weights")
    return folder


def labels(root: Path, key: str = "k") -> list[str]:
    return list(discover.list_models({key: [root]}))


def test_a_gguf_beside_config_json_is_offered_and_loads_with_that_config(tmp_path):
    from streamwise.runtime.checkpoint import load_pretrained
    from streamwise.runtime.cli.streamwise import main

    folder = tmp_path / "qwen"
    tiny_qwen2().save_pretrained(folder)
    assert main(["quantize", str(folder), str(folder / "model.gguf"), "--policy", "decoder-llm"]) == 0
    roots = {"LLM": [tmp_path]}
    assert list(discover.list_models(roots)) == ["LLM/qwen", "LLM/qwen/model.gguf", "LLM/qwen/model.safetensors"]

    picked = discover.resolve_model("LLM/qwen/model.gguf", roots)
    assert picked == folder / "model.gguf"
    assert Path(load_pretrained(picked, "decoder-llm").report.file).name == "model.gguf"
    # The folder's own label keeps loading what it loaded before the .gguf sat beside it.
    whole = load_pretrained(discover.resolve_model("LLM/qwen", roots), "decoder-llm")
    assert Path(whole.report.file).name == "model.safetensors"


def test_loose_weights_and_folders_that_cannot_load_are_not_offered(tmp_path):
    (tmp_path / "loose.gguf").write_bytes(b"weights")
    (tmp_path / "loose.safetensors").write_bytes(b"weights")
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "model.gguf").write_bytes(b"weights")
    model_folder(tmp_path / "config-only")  # a config.json and no weights: nothing to load
    model_folder(tmp_path / "two-files", "a.safetensors", "b.safetensors")  # as a folder: which one?
    model_folder(tmp_path / "gguf-only", "model.gguf")
    model_folder(tmp_path / "gguf-only" / "nested", "model.safetensors")  # a model folder inside one
    os.mkfifo(tmp_path / "gguf-only" / "pipe.gguf")  # opening it would block: never offered
    assert labels(tmp_path) == [
        "k/gguf-only", "k/gguf-only/model.gguf", "k/gguf-only/nested", "k/gguf-only/nested/model.safetensors",
        "k/two-files/a.safetensors", "k/two-files/b.safetensors",
    ]


def gguf_of(path, architecture, *strings):
    """A header-only GGUF as gguf's writer (llama.cpp's converter) makes it: the architecture first."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in strings:
        writer.add_string(key, value)
    writer.add_name("tiny")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_a_loose_gguf_is_offered_when_its_metadata_names_a_model(tmp_path):
    gguf_of(tmp_path / "llama.Q4_0.gguf", "llama")  # llama.cpp's layout: it builds its own skeleton
    gguf_of(tmp_path / "old.gguf", "streamwise")  # a Streamwise file carrying no config.json: nothing to build
    gguf_of(tmp_path / "tokenizer-only.gguf", "streamwise", ("streamwise.policy", "p"),
            ("streamwise.files", "tokenizer.json"))
    gguf_of(tmp_path / "mine.gguf", "streamwise", ("streamwise.policy", "p"),  # as `streamwise quantize` writes
            ("streamwise.files", "config.json,tokenizer.json"), ("streamwise.file.config.json", "{}" + " " * 4096))
    (tmp_path / "nested").mkdir()
    gguf_of(tmp_path / "nested" / "qwen3.gguf", "qwen3")
    (tmp_path / "huge-key.gguf").write_bytes(b"GGUF" + bytes(4) + bytes(8) + (1).to_bytes(8, "little")
                                             + (2**62).to_bytes(8, "little"))  # bounded: never read
    assert labels(tmp_path) == ["k/llama.Q4_0.gguf", "k/mine.gguf", "k/nested/qwen3.gguf"]


def test_a_root_beside_its_own_config_json_offers_its_files_only(tmp_path):
    model_folder(tmp_path, "model.gguf")
    assert labels(tmp_path) == ["k/model.gguf"]


def test_shards_are_offered_only_as_their_folder(tmp_path):
    folder = tmp_path / "sharded"
    tiny_qwen2().save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / SHARD_INDEX).is_file()
    (folder / "model-q8_0.gguf").write_bytes(b"weights")
    (folder / "extra.safetensors").write_bytes(b"weights")  # not in the index: a file of its own
    assert labels(tmp_path) == ["k/sharded", "k/sharded/extra.safetensors", "k/sharded/model-q8_0.gguf"]

    (folder / SHARD_INDEX).write_text("not json", encoding="utf-8")  # then any may be a shard
    assert labels(tmp_path) == ["k/sharded", "k/sharded/model-q8_0.gguf"]


def test_symlinked_folders_and_files_are_followed(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    model_folder(elsewhere / "qwen", "model.gguf")
    model_folder(elsewhere / "store" / "deep", "model.safetensors")
    root.mkdir()
    (root / "linked").symlink_to(elsewhere / "qwen", target_is_directory=True)
    (root / "store").symlink_to(elsewhere / "store", target_is_directory=True)
    snapshot = model_folder(root / "snapshot")  # a Hugging Face cache snapshot: every file a link to a blob
    (elsewhere / "blob").write_bytes(b"weights")
    (snapshot / "model.gguf").symlink_to(elsewhere / "blob")
    (snapshot / "broken.gguf").symlink_to(elsewhere / "gone")
    assert labels(root) == [
        "k/linked", "k/linked/model.gguf", "k/snapshot", "k/snapshot/model.gguf",
        "k/store/deep", "k/store/deep/model.safetensors",
    ]
    assert discover.resolve_model("k/linked/model.gguf", {"k": [root]}) == root / "linked" / "model.gguf"


def test_a_link_to_a_listed_folder_never_takes_over_its_label(tmp_path):
    model_folder(tmp_path / "z" / "real", "model.gguf")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "alias").symlink_to(tmp_path / "z" / "real", target_is_directory=True)  # walked first
    assert labels(tmp_path) == ["k/z/real", "k/z/real/model.gguf"]


def test_symlink_cycles_end(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    model_folder(root / "m", "model.gguf")
    (root / "m" / "up").symlink_to(root, target_is_directory=True)
    (root / "self").symlink_to(root / "self")  # a link to itself: the system refuses to follow it
    model_folder(outside / "a", "model.gguf")
    (outside / "a" / "back").symlink_to(outside / "b", target_is_directory=True)
    (outside / "b").symlink_to(outside / "a", target_is_directory=True)
    (root / "out").symlink_to(outside / "a", target_is_directory=True)
    assert labels(root) == ["k/m", "k/m/model.gguf", "k/out", "k/out/model.gguf"]


def test_labels_resolve_only_to_what_was_listed(tmp_path):
    root = tmp_path / "root"
    model_folder(root / "m", "model.gguf")
    model_folder(tmp_path / "outside", "model.gguf")
    roots = {"k": [root]}
    assert discover.resolve_model("k/m", roots) == root / "m"
    for label in ("k/../outside", "k/../outside/model.gguf", "k/m/../m", str(tmp_path / "outside"), "m", "x/m",
                  "k/m/config.json", "k/"):
        with pytest.raises(FileNotFoundError, match="no model"):
            discover.resolve_model(label, roots)


def test_the_first_root_of_a_key_wins_a_shared_label(tmp_path):
    first = model_folder(tmp_path / "first" / "m", "model.gguf")
    model_folder(tmp_path / "second" / "m", "model.gguf")
    model_folder(tmp_path / "other" / "m", "model.gguf")
    roots = {"k": [tmp_path / "first", tmp_path / "second", tmp_path / "missing"], "LLM": [tmp_path / "other"]}
    assert discover.list_models(roots) == {
        "LLM/m": tmp_path / "other" / "m", "LLM/m/model.gguf": tmp_path / "other" / "m" / "model.gguf",
        "k/m": first, "k/m/model.gguf": first / "model.gguf",
    }


def test_diffusers_model_folders_are_offered_whole_and_load(tmp_path):
    pytest.importorskip("diffusers")
    from streamwise.runtime.checkpoint import load_pretrained

    from helpers import tiny_diffusers

    model, _ = tiny_diffusers("vae")
    model.save_pretrained(tmp_path / "vae")
    model.save_pretrained(tmp_path / "vae", variant="fp16")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    (tmp_path / "variants").mkdir()
    for variant in ("fp16", "bf16"):  # no plain file: the folder loads with a dtype, and says so without one
        model.save_pretrained(tmp_path / "variants", variant=variant)
    roots = {"k": [tmp_path]}
    assert list(discover.list_models(roots)) == [
        "k/sharded", "k/vae", "k/vae/diffusion_pytorch_model.fp16.safetensors",
        "k/vae/diffusion_pytorch_model.safetensors", "k/variants",
        "k/variants/diffusion_pytorch_model.bf16.safetensors", "k/variants/diffusion_pytorch_model.fp16.safetensors",
    ]
    for label in ("k/sharded", "k/vae", "k/vae/diffusion_pytorch_model.fp16.safetensors"):
        report = load_pretrained(discover.resolve_model(label, roots), "any-module", progress=False).report
        assert report.built == "AutoencoderKL (diffusers `_class_name`)"
    report = load_pretrained(discover.resolve_model("k/variants", roots), "any-module", dtype=torch.bfloat16,
                             progress=False).report
    assert report.file.endswith("diffusion_pytorch_model.bf16.safetensors")


def settled(root: Path) -> None:
    """Every folder under `root` last changed a minute ago (a listing trusts only folders that settled)."""
    past = os.stat(root).st_mtime - 60
    for folder in [root, *(path for path in root.rglob("*") if path.is_dir() and not path.is_symlink())]:
        os.utime(folder, (past, past), follow_symlinks=False)


def test_a_listing_is_cached_on_the_folders_walked_and_walks_again_when_one_changes(tmp_path, monkeypatch):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    model_folder(root / "a", "model.gguf")
    model_folder(elsewhere / "b", "model.gguf")
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    settled(root), settled(elsewhere)
    scans = []
    real_scandir = os.scandir
    monkeypatch.setattr(discover.os, "scandir", lambda path: scans.append(path) or real_scandir(path))
    first = labels(root)
    walked = len(scans)
    assert first == ["k/a", "k/a/model.gguf", "k/linked/b", "k/linked/b/model.gguf"] and walked >= 4
    assert labels(root) == first and len(scans) == walked  # a prompt that changes nothing: no walk
    model_folder(elsewhere / "c", "model.gguf")  # added behind the link: that folder's time moves
    assert labels(root)[-2:] == ["k/linked/c", "k/linked/c/model.gguf"] and len(scans) > walked


def test_symlinks_are_followed_within_the_depth_and_folder_bounds(tmp_path, monkeypatch):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    model_folder(root / "1" / "2" / "shallow", "model.gguf")
    model_folder(root / "1" / "2" / "3" / "4" / "deep", "model.gguf")
    for index in range(50):  # a link to a large tree (`/`, say)
        (elsewhere / f"f{index:02d}").mkdir(parents=True)
    root.joinpath("everything").symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.setattr(discover, "MAX_DEPTH", 3)
    monkeypatch.setattr(discover, "MAX_FOLDERS", 20)
    scans = []
    real_scandir = os.scandir
    monkeypatch.setattr(discover.os, "scandir", lambda path: scans.append(path) or real_scandir(path))
    assert labels(root) == ["k/1/2/shallow", "k/1/2/shallow/model.gguf"]  # `deep` is 5 folders down
    assert len(scans) == 20
