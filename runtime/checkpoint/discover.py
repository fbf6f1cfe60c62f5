"""Model discovery: which models under a set of folders a picker offers (the ComfyUI loader's list). Only what
`load_pretrained` can load: weights with a `config.json` beside them (transformers' or diffusers'), or a loose `.gguf`
that describes its model: written by llama.cpp's converter, or by `streamwise quantize` carrying the model's
config.json (a loose `.safetensors` has nothing to build a skeleton from). A folder with a `config.json` is offered
whole when it holds weights the loader picks by itself (`weight_files`: its shard index, its one `.safetensors` or the
variants of one, else its one `.gguf`) and file by file (`folder/model.gguf`), shards excepted: they are parts of the
folder's weights. Symlinked folders are followed, each real folder once per root, so a cycle ends, and within bounds:
`MAX_DEPTH` folders below a root and `MAX_FOLDERS` folders visited per root (a link to `/` lists no more than that). A
listing is cached on the modification times of every folder it walked, as ComfyUI caches its own lists: a prompt that
changes nothing costs one `stat` per folder, no walk (a folder's time moves when an entry is added, removed or renamed
in it; one changed in the last `SETTLED_NS` is walked again, since a change within its clock tick would not move it).
Labels resolve back only to what was listed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import carried_files
from .gguf_header import leading_strings
from .weight_files import VARIANTS, NoWeights, is_shard_index, weights_file

WEIGHT_SUFFIXES = (".safetensors", ".gguf")
MAX_INDEX = 64 * 1024**2  # read on every listing: a larger "index" is not one worth parsing
MAX_DEPTH = 8  # folders below a root that are listed
MAX_FOLDERS = 4096  # folders visited per root

SETTLED_NS = 2 * 10**9  # a folder changed this recently may change again within its clock tick: walked again

_listed: dict[tuple, tuple[tuple[tuple[str, int | None], ...], dict[str, Path]]] = {}  # by roots: walked, listing


def list_models(roots: dict[str, Iterable[str | os.PathLike]]) -> dict[str, Path]:
    """`{"<folder key>/<relative path>": path}` for every loadable model under the given roots; the first root of a
    key wins a label two of them hold, as ComfyUI's own lookups do. Cached while no folder walked has changed."""
    key = tuple((name, tuple(map(str, folders))) for name, folders in roots.items())
    cached = _listed.get(key)
    settled = time.time_ns() - SETTLED_NS
    if cached is not None and all(at is not None and at < settled and _modified(folder) == at
                                  for folder, at in cached[0]):
        return dict(cached[1])
    found: dict[str, Path] = {}
    walked: list[tuple[str, int | None]] = []
    for name, folders in key:
        for folder in map(Path, folders):
            for relative, here, files, modified in _folders(folder):
                walked.append((str(here), modified))
                for label, path in _offered(relative, here, files):
                    found.setdefault(f"{name}/{label}", path)
    listing = dict(sorted(found.items()))
    _listed[key] = (tuple(walked), listing)
    return dict(listing)


def _modified(folder: str | Path) -> int | None:
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return None


def resolve_model(label: str, roots: dict[str, Iterable[str | os.PathLike]]) -> Path:
    models = list_models(roots)
    if label not in models:
        raise FileNotFoundError(f"no model `{label}` in the model folders (is it still there?)")
    return models[label]


def model_identity(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime) of every file loading `path` can read: a folder's own files, or a weight file and the
    `.json` files beside it (config, tokenizer, generation config). What a node's fingerprint compares, so that a
    replaced or re-downloaded model loads again and an unchanged one stays cached."""
    if path.is_dir():
        files = [entry for entry in path.iterdir() if entry.is_file()]
    else:
        files = [path, *(entry for entry in path.parent.glob("*.json") if entry.is_file())]
    identity = []
    for file in sorted(files):
        stat = file.stat()
        identity.append((str(file), stat.st_size, stat.st_mtime_ns))
    return tuple(identity)


def _folders(root: Path) -> Iterator[tuple[str, Path, set[str], int | None]]:
    """`(relative label prefix, folder, regular file names, its modification time)` for each folder under `root`,
    each real folder once, at most `MAX_DEPTH` below it and `MAX_FOLDERS` in all.

    Folders reached by their own path come before symlinked ones, so a link to a listed folder never takes over its
    label, and a link back up the tree (a cycle) reaches a folder already seen and ends there.
    """
    seen: set[str] = set()
    walk, links = [("", root)], []
    while (walk or links) and len(seen) < MAX_FOLDERS:
        if not walk:
            walk, links = sorted(links, reverse=True), []
        relative, here = walk.pop()
        real = os.path.realpath(here)
        if real in seen or relative.count("/") > MAX_DEPTH:
            continue
        seen.add(real)
        modified = _modified(here)  # before the scan: a change while it runs lists anew next time
        try:
            with os.scandir(here) as scan:
                entries = list(scan)
        except OSError:  # unreadable or gone: nothing to offer from it
            continue
        files, subfolders = set(), []
        for entry in entries:
            try:
                if entry.is_dir():
                    (links if entry.is_symlink() else subfolders).append((f"{relative}{entry.name}/", Path(entry.path)))
                elif entry.is_file():  # a FIFO or device is never offered: opening it would block
                    files.add(entry.name)
            except OSError:
                continue
        walk += sorted(subfolders, reverse=True)
        yield relative, here, files, modified


def _offered(relative: str, here: Path, files: set[str]) -> Iterator[tuple[str, Path]]:
    if "config.json" not in files:
        for name in sorted(files):
            if name.endswith(".gguf") and _describes_its_model(here / name):
                yield relative + name, here / name
        return
    weights = sorted(name for name in files if name.endswith(WEIGHT_SUFFIXES))
    if relative and _loads_whole(files):  # a root has no label of its own
        yield relative.rstrip("/"), here
    shards = _shards(here, sorted(name for name in files if is_shard_index(name)))
    for name in weights:
        if name.endswith(".gguf") or (shards is not None and name not in shards):
            yield relative + name, here / name


def _loads_whole(files: set[str]) -> bool:
    """Whether the loader picks the folder's weights by itself for some dtype (variants without a plain file need the
    dtype; loading with `auto` then says so)."""
    for variant in (None, *VARIANTS.values()):
        try:
            weights_file(files, variant)
            return True
        except NoWeights:
            continue
    return False


def _shards(folder: Path, indexes: list[str]) -> set[str] | None:
    """The files the shard indexes name; None when one cannot be read, and then no `.safetensors` beside it is offered
    alone (any may be a shard; the folder itself still is, and loading it says what is wrong with the index)."""
    shards: set[str] = set()
    for name in indexes:
        try:
            if (folder / name).stat().st_size > MAX_INDEX:
                return None
            shards |= set(json.loads((folder / name).read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None
    return shards


def _describes_its_model(path: Path) -> bool:
    """Whether a loose GGUF says what model to build: an architecture llama.cpp names, or Streamwise's carrying a
    config.json (`carried_files`)."""
    leading = leading_strings(path)
    architecture = leading.get("general.architecture")
    if architecture != carried_files.ARCHITECTURE:
        return architecture is not None
    return "config.json" in leading.get(carried_files.LISTED, "").split(",")
