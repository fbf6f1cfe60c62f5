"""GGUF files in llama.cpp's converter layout (`blk.0.attn_q.weight`, model shape in metadata) into transformers models.

Nothing here keeps a name table or a transform of its own: the config comes from transformers' GGUF metadata
reader (`AutoConfig.from_pretrained(..., gguf_file=...)`), tensor names from transformers' map built on the
gguf package's `TensorNameMap` (`get_gguf_hf_weights_map`), and the value transforms llama.cpp's converter
applied (Q/K rotary permutation, Gemma's norm + 1, ...) are undone by transformers' own per-architecture
`TensorProcessor`. What a processor does to a tensor is learned by handing it the row indices first: when it
only reorders rows (the Q/K permutation) the quantized blocks move as whole rows and stay quantized; when it
leaves the tensor alone the blocks pass through; anything else (a value change) needs the values, so that
tensor is dequantized, processed exactly as transformers does, and the load report says so.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .readers import Checkpoint, CheckpointError, StoredTensor

STREAMWISE_ARCHITECTURE = "streamwise"  # what `streamwise quantize` writes: tensor names are state-dict keys
_FULL_PROBE_LIMIT = 1 << 26  # a row-index probe of a whole 2-D tensor, at most this many elements


def supported_architectures() -> list[str]:
    """The GGUF architectures transformers reads config and tensor maps for (its legacy GGUF loader)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def _unsupported(path: str, architecture: str | None, detail: str = "") -> CheckpointError:
    return CheckpointError([
        f"{path}: a GGUF in llama.cpp's layout of architecture `{architecture}`, which Streamwise cannot map to a "
        f"transformers model{detail}; supported architectures: {', '.join(supported_architectures())}"
    ])


def is_llama_cpp_layout(checkpoint: Checkpoint, model: nn.Module) -> bool:
    """A GGUF not written by Streamwise whose tensor names are none of the model's own keys."""
    if checkpoint.kind != "gguf" or checkpoint.architecture in (None, STREAMWISE_ARCHITECTURE):
        return False
    return not set(checkpoint.tensors) & set(model.state_dict(keep_vars=True))


def gguf_metadata(path: str | Path) -> dict:
    """transformers' parse of the file's metadata (`config`, `tokenizer`, ...), or a CheckpointError
    naming the architecture when transformers cannot map it. Parsed once per version of the file: building the
    skeleton and mapping the tensors both ask, and a 150k-token vocabulary takes seconds to parse."""
    stat = os.stat(path)
    return _parsed_metadata(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed_metadata(path: str, size: int, modified: int) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from .readers import open_checkpoint

    architecture = open_checkpoint(path).architecture  # strict read first: a lying header never reaches transformers
    if architecture is None:
        raise CheckpointError([f"{path}: no `general.architecture` string in the GGUF metadata, so nothing says "
                               "which model it holds"])
    try:
        return load_gguf_checkpoint(path, return_tensors=False)
    except ValueError as exc:
        if "not supported" in str(exc):
            raise _unsupported(path, architecture) from None
        raise CheckpointError([f"{path}: transformers cannot read this GGUF's metadata ({exc})"]) from None
    except Exception as exc:  # its parser signals a malformed field with many exception types
        raise CheckpointError([f"{path}: transformers cannot read this GGUF's metadata "
                               f"({type(exc).__name__}: {exc})"]) from None


def gguf_config(path: str | Path):
    """The transformers config the GGUF's own metadata describes (no config.json needed)."""
    import gguf
    import transformers

    gguf_metadata(path)  # the architecture check, with Streamwise's error
    path = Path(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as exc:  # transformers signals a config it cannot build with many exception types
        raise CheckpointError([f"{path}: transformers cannot build a config from this GGUF ({exc})"]) from None
    # transformers reads the head size for some architectures only (Qwen3 keeps its class default of 128);
    # llama.cpp's converter writes it for all as the key length
    from .readers import _GGUFReader

    fields = _GGUFReader(path).fields
    key = gguf.Keys.Attention.KEY_LENGTH.format(arch=fields["general.architecture"].contents())
    if key in fields and isinstance(getattr(config, "head_dim", None), int):
        config.head_dim = int(fields[key].contents())
    return config


class Mapped:
    """A llama.cpp-layout GGUF seen under the model's state-dict keys, with what happened to each tensor."""

    def __init__(self, checkpoint: Checkpoint, model: nn.Module) -> None:
        from transformers import PreTrainedModel
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        path, architecture = checkpoint.path, checkpoint.architecture
        if not isinstance(model, PreTrainedModel):
            raise _unsupported(path, architecture, f" ({type(model).__name__} is not a transformers model)")
        config = gguf_metadata(path)["config"]
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
        try:
            self.names = get_gguf_hf_weights_map(model, self.processor)
        except NotImplementedError as exc:  # the gguf package has no name map for this model type
            raise _unsupported(path, architecture, f" ({exc})") from None
        self.checkpoint = checkpoint
        self.tensors: dict[str, StoredTensor] = {}
        self.ignored: dict[str, str] = {}
        self.dequantized: dict[str, str] = {}  # model key -> why its values were needed
        side: dict = {"tensors": {}}  # what processors that merge or rename tensors write themselves
        for name, stored in checkpoint.tensors.items():
            self._map(name, stored, side)
        for key, tensor in side["tensors"].items():
            self._add(key, StoredTensor(key, path, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t,
                                        note=f"assembled by transformers' {type(self.processor).__name__}"))

    def checkpoint_view(self) -> Checkpoint:
        return replace(self.checkpoint, tensors=self.tensors)

    def _add(self, key: str, stored: StoredTensor) -> None:
        if stored.note is not None:
            self.dequantized.setdefault(key, stored.note)
        self.tensors[key] = stored

    def _map(self, name: str, stored: StoredTensor, side: dict) -> None:
        processor = type(self.processor).__name__
        action = _probe(self.processor, name, stored.shape, self.names)
        if action is not None:
            key = self.names.get(name)
            if key is None:
                self.ignored[name] = "transformers maps it to no parameter of this model (it skips it too)"
                return
            self._add(key, replace(stored, name=key, read=_reordered(stored, action)))
            return
        # the processor changes values: it needs them, in float32 as transformers hands them over
        if stored.qtype is not None:
            from ..quant.gguf_dequant import dequantize

            values = dequantize(stored.read(), stored.qtype, stored.shape, torch.float32)
            note = f"dequantized from {stored.qtype.name}: transformers' {processor} changes its values"
        else:
            values, note = stored.read().float(), None
        result = self.processor.process(weights=values.numpy(), name=name, tensor_key_mapping=self.names,
                                        parsed_parameters=side)
        if result.name is None:  # the processor placed it in `side` itself
            return
        key = self.names.get(result.name)
        if key is None:
            self.ignored[name] = "transformers maps it to no parameter of this model (it skips it too)"
            return
        tensor = torch.from_numpy(np.ascontiguousarray(result.weights))
        if stored.qtype is None:
            tensor = tensor.to(stored.dtype)  # a float tensor keeps its stored dtype, as transformers' own path does
        self._add(key, StoredTensor(key, stored.file, tuple(tensor.shape), tensor.dtype, lambda t=tensor: t,
                                    note=note))


def _probe(processor, name: str, shape: tuple[int, ...], names: dict[str, str]):
    """What `processor` does to a tensor of `shape`, learned from row indices: `True` when it leaves it as it
    is, a row permutation (an index array) when it only reorders rows, None for anything else."""
    if not shape:
        return None
    rows = math.prod(shape[:-1]) if len(shape) > 1 else shape[0]
    index = np.arange(rows, dtype=np.int64).reshape(*shape[:-1], 1) if len(shape) > 1 else np.arange(rows)
    probes = [index]
    if len(shape) == 2 and math.prod(shape) <= _FULL_PROBE_LIMIT:  # a processor that reads the column count
        probes.append(np.broadcast_to(index, shape).copy())
    for probe in probes:
        try:
            with np.errstate(all="ignore"):
                result = processor.process(weights=probe.copy(), name=name, tensor_key_mapping=names,
                                           parsed_parameters={"tensors": {}})
        except Exception:
            continue
        if result.name != name or not isinstance(result.weights, np.ndarray) or result.weights.shape != probe.shape:
            return None
        if np.array_equal(result.weights, probe):
            return True
        if len(shape) != 2:
            return None
        rows_now = result.weights[:, 0]
        if (result.weights == rows_now[:, None]).all() and np.array_equal(np.sort(rows_now), np.arange(shape[0])):
            return torch.from_numpy(rows_now.astype(np.int64))
        return None
    return None


def _reordered(stored: StoredTensor, action):
    """`stored.read`, with its rows in the order `action` gives (whole rows of blocks for a quantized tensor)."""
    if action is True:
        return stored.read

    def read():
        data = stored.read()
        return data.reshape(stored.shape[0], -1)[action].reshape(data.shape)

    return read
