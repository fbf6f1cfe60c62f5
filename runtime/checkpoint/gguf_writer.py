"""`streamwise quantize`: write a checkpoint as GGUF, with GGML types chosen by a policy.

- each weight of a layer that a `gguf` quant rule selects is quantized to the rule's `gguf_type` (or the one type
  the caller gives) with the gguf package's own quantizers (every type it quantizes) and, for Q4_K, Q5_K and
  Q6_K, ggml's reference quantizers as ported in `k_quants` (`GGUF_WRITE_TYPES`);
- every other tensor keeps its type (the quantized blocks of a GGUF source too), and each weight matrix left in
  float is reported with why (no rule, excluded, another format, too few weights, rows not filling blocks);
- otherwise tensor names stay the model's state-dict keys, so `streamwise.load` reads the file back into the tree;
- the model's config.json and tokenizer files go into the metadata (`carried_files`), so the file stands alone;
- `Q4_K_M` / `Q5_K_M` give each tensor llama-quantize's type for its llama.cpp role (`llama_quant_mix`);
- a GGUF in llama.cpp's layout is requantized in that layout, as llama-quantize does (its names, order and metadata,
  the tokenizer included; the tensors byte for byte llama-quantize's where it can make them): llama.cpp loads it;
- a transformers model of a listed architecture is written in llama.cpp's layout, as its converter writes it
  (`llama_cpp_layout`: names, tensor forms, metadata, tokenizer; `layout="auto"` where it holds the model exactly),
  the types chosen as above: llama.cpp and Streamwise build the same model from its metadata, and the model's files
  are carried too, for its generation settings and tokenizer, which Streamwise reads as from the folder.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from ...schemas import Policy
from ...schemas.vocabulary import DEFAULT_GGUF_TYPE, GGUF_LAYOUTS, GGUF_WRITE_TYPES
from ..builders.skeleton import config_folder
from ..plan import plan_for
from ..plan.selectors import CompiledSelector, walk_modules
from ..quant import k_quants
from ..quant.gguf_dequant import dequantize
from . import carried_files
from .checked_file import file_type
from .conversion import under_model_keys
from .gguf_reader import ORIGINAL_SHAPE
from .limits import MAX_GGUF_DIMS
from .llama_cpp import is_llama_cpp_file
from .llama_cpp_layout import llama_cpp_architecture, llama_cpp_layout, llama_cpp_tensors
from .llama_quant_mix import MIXES, fitting, llama_order, mix_types, quantized
from .readers import CheckpointError, open_checkpoint
from .stored import StoredTensor


@dataclass(frozen=True)
class QuantizeReport:
    file: str
    tensors: int
    types: dict[str, int]
    bytes_in: int
    bytes_out: int
    float_layers: dict[str, str] = field(default_factory=dict)
    """Weight matrices written in float -> why no quantized type applies."""
    carried: tuple[str, ...] = ()
    """The model's files the GGUF carries (`carried_files`): with config.json it loads alone."""
    layout: str = "streamwise"
    """`streamwise` (state-dict names, the model's files carried) or `llama.cpp` (llama.cpp's names and metadata)."""
    tokenizer: str = ""
    """In llama.cpp's layout: the tokenizer the file holds, or why it holds none."""
    not_llama_cpp: str = ""
    """In Streamwise's layout: why not llama.cpp's, where `auto` chose (no listed architecture, ...)."""


def quantize_to_gguf(
    source: str | os.PathLike, destination: str | os.PathLike, policy: Policy | str, model: nn.Module | None, *,
    gguf_type: str | None = None, layout: str = "auto",
) -> QuantizeReport:
    """Write `source` to `destination` (a new `.gguf`) as `policy` says, every layer its `gguf` rules select in
    `gguf_type` when given (one of `GGUF_WRITE_TYPES`, or a mix of `MIXES`); an existing destination is replaced only
    once the whole file is written, and the source is never the destination. A GGUF in llama.cpp's layout is
    requantized in that layout, as llama-quantize does (`gguf_type` a mix, or one type for every tensor it quantizes;
    Q8_0 by default), and needs no `model`; the policy does not apply to it. `layout="llama.cpp"` writes a folder's
    model in llama.cpp's layout (`llama_cpp_layout`; a CheckpointError where it cannot), its types chosen so too."""
    if gguf_type is not None and gguf_type not in (*GGUF_WRITE_TYPES, *MIXES):
        raise CheckpointError([f"--type {gguf_type}: Streamwise writes {', '.join((*GGUF_WRITE_TYPES, *MIXES))}"])
    if layout not in GGUF_LAYOUTS:
        raise CheckpointError([f"--layout {layout}: Streamwise writes {', '.join(GGUF_LAYOUTS)}"])
    destination = Path(destination)
    opened = open_checkpoint(source)
    llama_cpp = is_llama_cpp_file(opened)  # requantized in its own layout, as llama-quantize would
    written, why_not = None, ""  # llama.cpp's layout of a transformers model, or why not
    if llama_cpp:
        checkpoint, files, policy_name = opened, [], None
        chosen = _llama_quantize_types(checkpoint, gguf_type or DEFAULT_GGUF_TYPE)
    else:
        policy, plan = plan_for(policy, model)
        policy_name = policy.name
        checkpoint = under_model_keys(opened, model)  # named as the model names them
        files = (carried_files.carried(checkpoint.metadata, checkpoint.path) if checkpoint.kind == "gguf"
                 else carried_files.collect(config_folder(Path(source))))
        if layout == "llama.cpp" and checkpoint.kind == "gguf":
            raise CheckpointError([f"{source}: --layout llama.cpp writes a model from its float weights (a folder or "
                                   "safetensors file); a GGUF in Streamwise's layout keeps it"])
        mixed, named = _mixed(gguf_type, model, checkpoint) if gguf_type in MIXES else (None, ())
        chosen = (_by_key(mixed, named) if mixed is not None else
                  {f"{e.path}.weight": gguf_type or e.gguf_type for e in plan.modules if e.gguf_type})
        written, why_not = _layout(layout, model, checkpoint, Path(source))
        if written is not None:
            chosen = mixed if mixed is not None else {t.name: chosen[t.key] for t in written.tensors if t.key in chosen}
    _check_destination(destination, {Path(t.file) for t in checkpoint.tensors.values()} | {Path(checkpoint.path)})
    handle, partial = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".partial", dir=destination.parent)
    os.close(handle)
    types: dict[str, int] = {}
    left: dict[str, str] = {}  # weight -> why it stays float
    bytes_in = 0
    try:
        if llama_cpp:
            writer = gguf.GGUFWriter(partial, arch=checkpoint.architecture)
            _copy_metadata(checkpoint.path, writer, gguf_type or DEFAULT_GGUF_TYPE)
        elif written is not None:  # llama.cpp's metadata, then the folder's other files, which llama.cpp ignores
            writer = gguf.GGUFWriter(partial, arch=written.architecture)
            written.write_metadata(writer)
            writer.add_file_type(_file_type(gguf_type or _most_common(chosen)))
            writer.add_string("streamwise.policy", policy_name)
            for key, value in carried_files.metadata(files):
                writer.add_string(key, value)
        else:
            writer = gguf.GGUFWriter(partial, arch=carried_files.ARCHITECTURE)
            writer.add_string("streamwise.policy", policy_name)
            for key, value in carried_files.metadata(files):
                writer.add_string(key, value)
        order = llama_order if llama_cpp else None
        tensors = (_in_layout(written, checkpoint, chosen) if written is not None else
                   ((name, name, stored, chosen.get(name)) for name, stored in sorted(checkpoint.tensors.items(),
                                                                                     key=order)))
        try:
            for file_name, name, stored, wanted in tensors:
                data, qtype, size = _convert(name, stored, wanted)
                if len(stored.shape) > MAX_GGUF_DIMS:  # no GGUF holds it: rows of its first dimension, as ComfyUI-GGUF
                    data = data.reshape(stored.shape[0], -1)
                    writer.add_array(ORIGINAL_SHAPE.format(name=file_name), [int(d) for d in stored.shape])
                if name.endswith(".weight") and len(stored.shape) >= 2 and (qtype is None or qtype.name in _FLOATS):
                    if wanted not in _FLOATS:  # a float type a rule chose is no layer left behind
                        left[name] = _why_float(stored.shape, wanted)
                bytes_in += size
                writer.add_tensor(file_name, data, raw_dtype=qtype)
                label = (qtype.name if qtype is not None else str(data.dtype))
                types[label] = types.get(label, 0) + 1
            try:
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_tensors_to_file()
            except OSError as exc:  # numpy's short write says only "N requested and M written"
                raise CheckpointError([f"{destination}: writing stopped after {_size_of(partial)} bytes ({exc}): "
                                       f"{_why_short(destination.parent)}; nothing was written (the partial file is "
                                       "removed)"]) from None
        finally:
            writer.close()
        # mkstemp makes the file private; the result takes the mode the file it replaces had, else the umask's
        os.chmod(partial, stat.S_IMODE(destination.stat().st_mode) if destination.exists() else _umask_mode())
        os.replace(partial, destination)
    except BaseException:
        Path(partial).unlink(missing_ok=True)  # never leave half a file behind, nor touch the destination
        raise
    unselected = ({} if gguf_type in MIXES or llama_cpp else
                  _unselected(policy, plan, model, [name.rpartition(".")[0] for name, why in left.items() if not why]))
    kept = (f"{gguf_type or DEFAULT_GGUF_TYPE} keeps it as llama-quantize does (no weight matrix it quantizes, or no "
            "llama.cpp name)")
    return QuantizeReport(
        os.fspath(destination), sum(types.values()), dict(sorted(types.items())), bytes_in,
        os.path.getsize(destination),
        {name: why or unselected.get(name.rpartition(".")[0], kept) for name, why in left.items()},
        tuple(files), "llama.cpp" if llama_cpp or written is not None else "streamwise",
        written.tokenizer if written is not None else "", why_not,
    )


def _layout(layout: str, model: nn.Module, checkpoint, source: Path):
    """llama.cpp's layout of `model` where `layout` asks for it (`auto`: where it holds the model exactly), else None
    and why not (empty where Streamwise's layout was asked for)."""
    if layout == "streamwise" or checkpoint.kind == "gguf":
        return None, ""
    if layout == "auto" and llama_cpp_architecture(model) is None:
        return None, f"{type(model).__name__} is of no architecture Streamwise writes in llama.cpp's layout"
    try:
        written = llama_cpp_layout(model, config_folder(source))
    except CheckpointError as exc:
        if layout == "llama.cpp":
            raise
        return None, exc.problems[0]
    if layout == "auto" and written.inexact:
        return None, (f"llama.cpp's layout stores {', '.join(written.inexact[:2])} as the converter's arithmetic "
                      "(1 + w, -exp), which reads back within a float32 unit, not bit for bit: --layout llama.cpp "
                      "writes it anyway")
    return written, ""


def _in_layout(layout, checkpoint, chosen: dict[str, str]):
    """(file name, state-dict key, tensor in llama.cpp's form, type chosen by its name) for each tensor of `layout`
    the checkpoint holds (a tied one it leaves out is left out): one llama.cpp computes in F32 is written so."""
    for tensor in layout.tensors:
        stored = checkpoint.tensors.get(tensor.key)
        if stored is None and tensor.tied:
            continue
        if stored is None:
            raise CheckpointError([f"{checkpoint.path}: `{tensor.key}` is missing from the checkpoint"])
        values = tensor.form(stored.read())
        values = values.float() if tensor.f32 else values
        formed = replace(stored, name=tensor.name, shape=tuple(values.shape), read=lambda v=values: v)
        yield tensor.name, tensor.key, formed, None if tensor.f32 else chosen.get(tensor.name)
    for name, values in layout.computed.items():  # what the converter computes from the config, in F32
        computed = StoredTensor(name, checkpoint.path, tuple(values.shape), values.dtype, lambda v=values: v)
        yield name, name, computed, None


def _most_common(chosen: dict[str, str]) -> str:
    """The type most tensors were given: what `general.file_type` says of a file whose types a policy chose."""
    kinds = list(chosen.values())
    return max(set(kinds), key=kinds.count) if kinds else "F16"


def _file_type(gguf_type: str) -> gguf.LlamaFileType:
    """The llama.cpp file type a file whose tensors are mostly `gguf_type` has (`LLAMA_FTYPE_MOSTLY_Q4_K_M`, ...), as
    llama-quantize writes it."""
    names = {"F32": "ALL_F32", "MXFP4": "MOSTLY_MXFP4_MOE", **{k: f"MOSTLY_{k}_S" for k in ("Q4_K", "Q5_K")}}
    return gguf.LlamaFileType[names.get(gguf_type, f"MOSTLY_{gguf_type}")]


def _llama_quantize_types(checkpoint, gguf_type: str) -> dict[str, str]:
    """Each tensor's type in a llama.cpp-layout file requantized to `gguf_type` (`_by_role`)."""
    metadata, architecture = checkpoint.metadata, checkpoint.architecture
    count = metadata.get(gguf.Keys.LLM.EXPERT_COUNT.format(arch=architecture))
    layers = metadata.get(gguf.Keys.LLM.BLOCK_COUNT.format(arch=architecture))
    return _by_role(gguf_type, {name: stored.shape for name, stored in checkpoint.tensors.items()}, architecture,
                    layers.integers[0] if layers else 0, count.integers[0] if count else 0)


def _by_role(gguf_type: str, shapes: dict[str, tuple[int, ...]], architecture: str, layers: int,
             experts: int) -> dict[str, str]:
    """Each llama.cpp tensor's type as llama-quantize gives it: a mix's choices, or one type for every tensor it
    quantizes (its `--pure`), falling back where rows do not fill the type's blocks."""
    if gguf_type in MIXES:
        types = mix_types(gguf_type, shapes, architecture=architecture, layers=layers, experts=experts)
    else:
        kind = gguf.GGMLQuantizationType[gguf_type]
        types = {name: fitting(kind, shape[-1]) for name, shape in shapes.items() if quantized(name, shape)}
    return {name: kind.name for name, kind in types.items()}


def _copy_metadata(path: str, writer: gguf.GGUFWriter, gguf_type: str) -> None:
    """A llama.cpp file's metadata, every key as it was (its tokenizer included), but `general.file_type`."""
    file_type = _file_type(gguf_type)
    for key, found in gguf.GGUFReader(path).fields.items():  # a header the strict reader has checked
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue
        if key == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        array = found.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, found.contents(), found.types[0], found.types[-1] if array else None)


def _mixed(gguf_type: str, model: nn.Module, checkpoint) -> tuple[dict[str, str], tuple]:
    """Each llama.cpp tensor's type as llama-quantize gives it (`_by_role`), by its llama.cpp name and shape in
    llama.cpp's form (`llama_cpp_tensors`, those the checkpoint holds: a tied head it leaves out makes the embedding the
    output): every weight matrix llama-quantize quantizes, whatever the policy selects; and those tensors."""
    try:
        architecture, tensors = llama_cpp_tensors(model)
    except CheckpointError as exc:
        if gguf_type not in MIXES:
            raise
        raise CheckpointError([f"--type {gguf_type}: llama-quantize chooses its types by llama.cpp tensor roles, and "
                               f"{exc.problems[0]}; give one type instead (--type {MIXES[gguf_type].name})"]) from None
    config = model.config
    held = {tensor.name: tensor.shape for tensor in tensors if tensor.key in checkpoint.tensors}
    types = _by_role(gguf_type, held, architecture, config.num_hidden_layers,
                     getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0)
    return types, tensors


def _by_key(by_name: dict[str, str], tensors) -> dict[str, str]:
    """Types chosen by llama.cpp name, by state-dict key (a fused gate-and-up expert tensor takes its gate's)."""
    chosen: dict[str, str] = {}
    for tensor in tensors:
        if tensor.name in by_name:
            chosen.setdefault(tensor.key, by_name[tensor.name])
    return chosen


def _too_small(path: str, module: nn.Module | None, rules: list) -> object | None:
    """The gguf rule selecting `module` that its `min_weights` dropped (the deciding rule must be such a one when a
    gguf rule selects a module the plan left without a quant role)."""
    weight = getattr(module, "weight", None)
    if module is None or weight is None:
        return None
    return next((rule for rule, selector in rules
                 if weight.numel() < rule.min_weights and selector.matches_module(path, module)), None)


def _why_float(shape: tuple[int, ...], gguf_type: str | None) -> str:
    """Why a weight a rule chose `gguf_type` for stays float ("": no type was chosen, `_unselected` says why)."""
    if gguf_type is None:
        return ""
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]
    return f"its rows of {shape[-1]} values do not fill whole {gguf_type} blocks of {block}"


def _unselected(policy: Policy, plan, model: nn.Module, paths: list[str]) -> dict[str, str]:
    """Why no `gguf` rule chose a type for each module at `paths`: what its plan entry or the [quant] section says."""
    entries = {entry.path: entry for entry in plan.modules}
    modules = dict(walk_modules(model))
    quant = policy.quant
    exclude = CompiledSelector(quant.exclude) if quant.exclude else None
    rules = [(rule, CompiledSelector(rule.select)) for rule in quant.rule if rule.format == "gguf"]
    reasons = {}
    for path in paths:
        entry, module = entries.get(path), modules.get(path)
        if entry is not None and entry.quant == "none":
            reasons[path] = f"quant rule `{entry.quant_rule}` keeps it float"
        elif entry is not None and entry.quant:
            reasons[path] = f"quant rule `{entry.quant_rule}` makes it `{entry.quant}`, which a GGUF does not hold"
        elif module is not None and exclude is not None and exclude.matches_module(path, module):
            reasons[path] = "[quant] exclude selects it"
        elif (small := _too_small(path, module, rules)) is not None:
            reasons[path] = f"it has fewer than the {small.min_weights} weights quant rule `{small.id}` asks for"
        else:
            reasons[path] = "no gguf quant rule selects it"
    return reasons


def _size_of(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _why_short(folder: Path) -> str:
    """What can stop a write short: this process's file-size limit, or the disk's free space, with figures."""
    try:
        import resource  # POSIX only
    except ImportError:
        resource = None
    if resource is not None:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return f"this process may write files of at most {limit} bytes (`ulimit -f`): raise the limit"
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "the disk is full or the file system refused the write"
    return f"the disk holds {free} free bytes there: free some space, or write the GGUF elsewhere"


def _umask_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _check_destination(destination: Path, sources: set[Path]) -> None:
    if destination.suffix != ".gguf":
        raise CheckpointError([f"{destination}: the destination must be a `.gguf` file"])
    kind = file_type(destination)  # a name too long or with a NUL byte is a CheckpointError too
    if kind not in (None, stat.S_IFREG) or file_type(destination.parent) != stat.S_IFDIR:
        raise CheckpointError([f"{destination}: not a file in an existing folder"])
    if kind is not None and any(destination.samefile(s) for s in sources if s.exists()):
        raise CheckpointError([f"{destination}: is the source checkpoint; write the GGUF to a new file"])


def _convert(
    name: str, stored: StoredTensor, gguf_type: str | None,
) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None, int]:
    """The array to write, its GGML type, and the size of the source tensor it comes from.

    A source that is already quantized (a GGUF) keeps its blocks unless a rule asks for another
    type; then it is dequantized and encoded afresh.
    """
    raw = stored.read()
    size = raw.nbytes
    if stored.qtype is None:
        return (*_encode(name, raw, gguf_type), size)
    if gguf_type is None or gguf_type == stored.qtype.name:
        return raw.numpy().reshape(*stored.shape[:-1], -1), stored.qtype, size
    try:
        values = dequantize(raw, stored.qtype, stored.shape)
    except ValueError as exc:  # a type without a dequantizer
        raise CheckpointError([f"{stored.file}: tensor `{name}`: {exc}"]) from None
    return (*_encode(name, values, gguf_type), size)


def _encode(
    name: str, tensor: torch.Tensor, gguf_type: str | None,
) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """The array to write and its GGML type (None: the array's own numpy type)."""
    if gguf_type is not None:
        qtype = gguf.GGMLQuantizationType[gguf_type]
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        if gguf_type in ("F32", "F16"):
            return tensor.to(torch.float32 if gguf_type == "F32" else torch.float16).numpy(), None
        if tensor.ndim >= 2 and tensor.shape[-1] % block == 0:
            quantize = k_quants.quantize if qtype in k_quants.QUANTIZERS else gguf.quants.quantize
            return quantize(tensor.float().numpy(), qtype), qtype
    # Not quantized (or rows that do not fill whole blocks): the tensor's own type, unchanged.
    if tensor.dtype == torch.bfloat16:
        bf16 = gguf.GGMLQuantizationType.BF16
        return gguf.quants.quantize(tensor.float().numpy(), bf16), bf16
    if tensor.dtype not in _NUMPY_TYPES:
        raise CheckpointError([f"tensor `{name}`: GGUF cannot store {tensor.dtype}"])
    return tensor.numpy(), None


_FLOATS = ("F32", "F16", "BF16")
_NUMPY_TYPES = (torch.float32, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64)
