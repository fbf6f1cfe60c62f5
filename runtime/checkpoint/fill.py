"""`load(model, path, policy)`: fill a skeleton tree from a checkpoint, converting it as it goes.

Everything is checked before the first change (missing, extra and misshapen tensors, dtype mismatches, unknown quant
formats, a plan that does not fit): on any problem the model is left exactly as it was and a `CheckpointError` names
the file and every offending tensor. What fails after that (memory, Ctrl-C) is undone through the same journal as
`apply`: the model is again as it was, an interrupt stays an interrupt, and any other error becomes a
`CheckpointError` caused by it. Tensors are read into memory of their own, or left in the file within a host budget
(`tiers`); GGUF tensors that a `gguf` rule selects stay in their raw blocks as residents (other quantized GGUF
tensors, embeddings and convolutions, are dequantized once, each with its reason in the report); `.comfy_quant`
layers load as INT8 residents; int8-family rules quantize the float weights on load. A GGUF in llama.cpp's layout
(`blk.0.attn_q.weight`) is seen under the model's own keys first (`llama_cpp.Mapped`), and so is a transformers
checkpoint in its published layout (`conversion`: renamed keys, stacked experts, the base model's prefix).
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ...schemas import Policy
from ..convert import ConversionError, applied_state, apply, check
from ..engine import protocol, widened
from ..engine.exclusive import one_writer
from ..engine.file_reads import FileTier
from ..engine.file_tier import FileSource, Sources, in_memory
from ..engine.journal import Journal
from ..engine.row_reads import RowReads, row_reads
from ..host_memory import return_large_frees
from ..plan import plan_for
from ..policy.diagnostics import PolicyError
from ..quant import dequant_cache
from ..quant.convrot import check_group_size
from ..quant.formats import ARITHMETICS, FORMATS
from ..quant.residents import expansion_bytes, make_resident
from ..sizes import human
from . import comfy_quant, leased
from .conversion import under_model_keys
from .errors import LoadOptionError
from .readers import CheckpointError, open_checkpoint
from .stored import Checkpoint, FileRange, StoredTensor
from .tiers import Tiers, Unit, host_budget, place, read_in

_log = logging.getLogger("streamwise.load")
_HALF_FLOATS = (torch.float16, torch.bfloat16)  # what a `gguf` rule keeps as GGML F16/BF16 storage


@dataclass(frozen=True)
class LoadReport:
    file: str
    tensors: int
    bytes: int
    residents: dict[str, int]
    dequantized: int
    """How many quantized tensors of the file were dequantized (`dequantized_tensors` says which and why)."""
    quantized: dict[str, str] = field(default_factory=dict)
    """Model key -> the GGML type it stays in, as a resident."""
    dequantized_tensors: dict[str, str] = field(default_factory=dict)
    """Model key -> why its quantized values were dequantized."""
    ignored: dict[str, str] = field(default_factory=dict)
    """File tensor -> why nothing in the model takes it (a llama.cpp-layout GGUF only)."""
    built: str | None = None
    """Which class `load_pretrained` built and why (`WhisperForConditionalGeneration (config.architectures)`); None
    from `load`, which fills a tree it is given."""
    covered: str = "100.00%"
    """The share of the tree's bytes its plan streams or relocates (`Coverage.percent`): below 100%, tensors are
    stranded."""
    tiers: Tiers | None = None
    """What is in host memory and what stayed in the file (`tiers.place`)."""
    cpu_arithmetic: dict[str, str] = field(default_factory=dict)
    """The residents' GGML type (GGUF) or format (the others), and `F16`/`BF16` for half-precision Linear weights ->
    how they compute on the CPU: `int8` (activations quantized per block, as llama.cpp; relative error about 5e-3 per
    layer), `bf16` (INT8's packed kernel), `float32` (a resident's weight expanded, then `F.linear`; a half-precision
    weight's exact products summed in float32, `engine.widened`)."""

    def __str__(self) -> str:
        """One line for people: the class built, what was read, what stayed quantized (by type), what was dequantized
        (by reason)."""
        parts = [f"built {self.built}"] if self.built else []
        parts.append(f"{self.tensors} tensors ({human(self.bytes)}) from {Path(self.file).name}")
        if self.quantized:
            parts.append(f"{len(self.quantized)} kept quantized ({_tally(self.quantized.values())})")
        if self.cpu_arithmetic:
            by = {how: [t for t, a in self.cpu_arithmetic.items() if a == how] for how in self.cpu_arithmetic.values()}
            parts.append("on the CPU " + ", ".join(f"{', '.join(types)} in {how}" for how, types in by.items()))
        if self.dequantized:
            why = f" ({_tally(self.dequantized_tensors.values())})" if self.dequantized_tensors else ""
            parts.append(f"{self.dequantized} dequantized{why}")
        if self.residents:
            parts.append("residents " + ", ".join(f"{name} x{count}" for name, count in self.residents.items()))
        if self.ignored:
            parts.append(f"{len(self.ignored)} file tensors unused")
        parts.append(f"covered {self.covered}")
        if self.tiers is not None and self.tiers.file_bytes:
            parts.append(str(self.tiers))
        return "; ".join(parts)


def _tally(values: Iterable[str]) -> str:
    counts = Counter(values)
    return ", ".join(f"{value} x{count}" for value, count in sorted(counts.items(), key=lambda item: -item[1]))


def load(
    model: nn.Module,
    path: str | os.PathLike,
    policy: Policy | str | Path,
    *,
    dtype: torch.dtype | None = None,
    progress: Callable[[int, int], None] | bool | None = None,
    allow_stranded: bool = True,
    max_memory: object = None,
    file_tier: bool = True,
    arithmetic: str = "int8",
) -> LoadReport:
    """Load `path` into `model` as `policy` says, then convert the tree (see `apply`); the report is also logged
    (logger `streamwise.load`).

    `dtype` converts floating-point tensors; without it a file dtype that differs from the
    model's is an error. `progress(done, total)` is called as tensors are placed; without one, a
    tqdm bar shows on a terminal; `progress=False` shows none. `allow_stranded=False` refuses a plan that strands
    tensors before anything is read (`Plan.refuse_stranded`): what the ComfyUI loader asks. `max_memory` is the host
    budget (`tiers.host_budget`: by default what this process can spare): streamed units past it stay in the file and
    are read at each forward (`engine.file_tier`); the tree keeps the budget and where each tensor can be read back
    from, for a later `offload`. `file_tier=False` keeps everything in memory (for code that reads weights directly,
    outside a fetch): what does not fit the budget is then refused before anything is read. `arithmetic` is how
    quantized residents compute on the CPU where a kernel reads their storage in place (`quant.formats.ARITHMETICS`:
    `int8` as llama.cpp, `float32` exact); the report says what each type takes (`LoadReport.cpu_arithmetic`).
    Half-precision Linear weights compute in float32 on the CPU whatever it says (`engine.widened`: several rows at
    once widened a slab of weight rows at a time, where the CPU has no half-precision kernels of its own).
    """
    if arithmetic not in ARITHMETICS:
        raise LoadOptionError(f"arithmetic {arithmetic!r}: expected one of {', '.join(ARITHMETICS)}")

    def failed(exc: Exception) -> CheckpointError | None:  # the errors that say what failed pass as they are
        if isinstance(exc, (CheckpointError, ConversionError, PolicyError)):
            return None
        return CheckpointError([f"{path}: loading failed ({exc!r}); the model was restored unchanged"])

    journal = Journal()  # what can still fail after the checks (quantizing on load: memory) undoes everything
    with one_writer(model), journal.atomic(failed):
        _, plan = plan_for(policy, model)
        if not allow_stranded:
            plan.refuse_stranded()
        checkpoint = open_checkpoint(path, dtype)
        mapped = None
        if checkpoint.kind == "gguf":  # imported for GGUF files alone, as `gguf_reader` is (readers.open_checkpoint)
            from ..quant import gguf_dequant
            from .llama_cpp import Mapped, is_llama_cpp_layout

            mapped = Mapped(checkpoint, model) if is_llama_cpp_layout(checkpoint, model) else None
            gguf_dequant.prepare(torch.device("cpu"))  # its CPU kernels' memory taken before the host budget is read
        checkpoint = mapped.checkpoint_view() if mapped is not None else under_model_keys(checkpoint, model)
        filling = _Filling(model, checkpoint, {m.path: m for m in plan.modules}, dtype, arithmetic)
        filling.collect()
        if filling.problems:
            raise CheckpointError(filling.problems)
        check(plan, model)  # a plan that cannot be applied fails before the first assignment
        must_hold, units = filling.units(plan)
        expanded = [model.get_submodule(m.path) for m in plan.modules if filling.expands(m)]
        tiers = place(checkpoint.path, must_hold, units, host_budget(max_memory), file_tier=file_tier,
                      working=expansion_bytes(expanded))
        if tiers.in_file:  # short of memory: what the load and the forwards free goes back to the system
            return_large_frees()
        filling.read_in(tiers)  # every read error surfaces here, before the tree changes
        reads = FileTier(tiers.slabs, tiers.staging_bytes // tiers.slabs)  # arenas the size the budget counted
        if progress is None or progress is True:
            from tqdm import tqdm

            with tqdm(total=len(filling.tensors) + len(filling.residents), desc="streamwise load", unit="tensor",
                      disable=None, leave=False) as bar:
                filling.assign(lambda done, total: bar.update(done - bar.n), journal, reads)
        else:
            filling.assign(progress or (lambda done, total: None), journal, reads)
        apply(plan, model, journal=journal)
        for module in model.modules():  # every resident, from the file or quantized now, and half-precision Linear
            if protocol.quant_handler(module) is not None:
                journal.set_attributes(module, {protocol.ARITHMETIC: arithmetic})
            elif _half_linear(module):
                journal.set_attributes(module, {protocol.ARITHMETIC: widened.ARITHMETIC})
        tree = applied_state(model).tree
        journal.set_attributes(tree, {"file_tier": reads, "host_budget": tiers.budget})
        if tiers.budget is not None:  # dequantized weights kept for reuse live in what the budget leaves
            left = tiers.budget - tiers.host_bytes - tiers.staging_bytes - tiers.working_bytes
            dequant_cache.DEQUANT_CACHE.limit(left)
        for unit in units:
            if any(key in tiers.in_file for key, _ in unit.values):
                for path in (unit.path, *unit.also):
                    leaf = model.get_submodule(path)
                    journal.keep(leaf, (protocol.FETCH_FLAG,))
                    protocol.set_fetching(leaf, True)  # its weights come from the file at each forward
    residents: dict[str, int] = {}
    for module in model.modules():
        handler = protocol.quant_handler(module)
        if handler is not None:
            residents[handler.name] = residents.get(handler.name, 0) + 1
    report = LoadReport(
        checkpoint.path, len(filling.tensors) + len(filling.residents), tiers.host_bytes + tiers.file_bytes,
        dict(sorted(residents.items())), len(filling.dequantized), dict(sorted(filling.kept.items())),
        dict(sorted(filling.dequantized.items())), dict(sorted(mapped.ignored.items())) if mapped is not None else {},
        covered=plan.coverage.percent, tiers=tiers, cpu_arithmetic=_cpu_arithmetic(model),
    )
    mapped_from = leased.leases_of([t for t in (*model.parameters(), *model.buffers()) if in_memory(t)])
    if mapped_from:  # a file cut under its mapping reads zeros (`fault_guard`): no forward returns what they gave
        checking = leased.LeaseCheck(mapped_from)
        model.register_forward_pre_hook(checking)
        model.register_forward_hook(checking)
    _log.info("load: policy `%s`, %s", plan.policy, report)
    return report


def _half_linear(module: nn.Module) -> bool:
    """Whether `module` is a Linear leaf holding a half-precision weight (`engine.widened`)."""
    return protocol.kind_of(module) == "linear" and getattr(module.weight, "dtype", None) in widened.HALF_TYPES


def _cpu_arithmetic(model: nn.Module) -> dict[str, str]:
    """`LoadReport.cpu_arithmetic` of a loaded tree."""
    found = {}
    for module in model.modules():
        handler = protocol.quant_handler(module)
        if handler is not None:
            name = handler.name if handler.name != "gguf" else module.gguf_qtype.name
            found[name] = handler.cpu_arithmetic(module)
        elif _half_linear(module):
            found[widened.HALF_TYPES[module.weight.dtype]] = widened.ARITHMETIC
    return dict(sorted(found.items()))


def _sharing(one: RowReads | None, other: RowReads | None) -> RowReads | None:
    """How a unit of two leaves sharing a tensor reads it: whole where either does, else in chunks where either does,
    else gathering rows."""
    if one is None or other is None:
        return None
    return "chunks" if "chunks" in (one, other) else "gather"


class _Filling:
    """What a checkpoint puts where: gathered and checked in full before anything is assigned."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint, plans: dict, dtype: torch.dtype | None,
                 arithmetic: str) -> None:
        self.model, self.checkpoint, self.plans, self.dtype = model, checkpoint, plans, dtype
        self.arithmetic = arithmetic
        self.tensors: dict[str, Tensor] = {}
        self.residents: dict[str, tuple[str, dict[str, Tensor], dict[str, object]]] = {}
        self.problems: list[str] = []
        self.dequantized: dict[str, str] = {}  # model key -> why
        self.kept: dict[str, str] = {}  # model key -> GGML type kept as a resident
        self.aliases: dict[str, list[str]] = {}
        self.buffers: set[str] = set()  # keys of buffers: they never stay in the file
        self.sources: dict[str, FileSource] = {}  # key -> where its value can be read back from

    def problem(self, name: str, message: str) -> None:
        stored = self.checkpoint.tensors.get(name)  # in a sharded folder: the shard that holds it
        self.problems.append(f"{stored.file if stored else self.checkpoint.path}: tensor `{name}`: {message}")

    def collect(self) -> None:
        expected = self.model.state_dict(keep_vars=True)
        self.buffers = {name for name, tensor in expected.items() if not isinstance(tensor, nn.Parameter)}
        groups: dict[int, list[str]] = {}
        for name, tensor in expected.items():
            groups.setdefault(id(tensor), []).append(name)
        consumed = set(self._comfy_quant(expected))
        for names in groups.values():
            names = [n for n in names if n not in consumed]  # a tied partner stored as a .comfy_quant layer unties
            if not names or any(n in self.tensors for n in names):
                continue
            present = [n for n in names if n in self.checkpoint.tensors]
            if not present:
                self.problem(names[0], "missing from the file")
                continue
            consumed.update(present)
            first = self.checkpoint.tensors[present[0]]
            for other in present[1:]:  # tied in the model, stored twice in the file: only one value can win
                stored = self.checkpoint.tensors[other]
                same = stored.shape == first.shape and stored.dtype == first.dtype
                if not same or not torch.equal(stored.read(), first.read()):
                    self.problem(
                        other, f"tied to `{present[0]}` in the model, but the file stores a different value for it",
                    )
            self._take(names, expected[names[0]], first)
        for name in sorted(set(self.checkpoint.tensors) - consumed):
            self.problem(name, "not in the model (an extra tensor)")
        for module_path, module in self.model.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                key = f"{module_path}.{name}".lstrip(".")
                if buffer.is_meta and key not in expected:
                    self.problem(key, "a non-persistent buffer on the meta device: build the model inside "
                                 "`streamwise.skeleton()`, which keeps buffers computed in `__init__` real (not a "
                                 "large one `torch.empty` makes there: compute it with another op)")

    def _take(self, names: list[str], current: Tensor, stored: StoredTensor) -> None:
        name = names[0]
        if stored.shape != tuple(current.shape):
            self.problem(name, f"shape {list(stored.shape)} in the file, {list(current.shape)} in the model")
            return
        target = self.dtype if (self.dtype is not None and current.is_floating_point()) else current.dtype
        module_path, _, attribute = name.rpartition(".")
        in_file = isinstance(stored.read, FileRange)  # nothing transformed it: it can be read back at a fetch
        if stored.qtype is not None:
            from ..quant.gguf_dequant import check_blocks, dequantize  # a GGUF file's: gguf_reader imported it

            if not current.is_floating_point():
                self.problem(name, f"a quantized {stored.qtype.name} tensor in the file, {current.dtype} in the model")
                return
            blocks = None if in_file else stored.read()
            try:
                check_blocks(stored.qtype, stored.shape, stored.read.nbytes if in_file else blocks.numel())
            except ValueError as exc:  # UnsupportedQuantType too
                self.problem(name, str(exc))
                return
            if self._keeps_gguf_storage(module_path, attribute):
                attributes = {"gguf_qtype": stored.qtype, "gguf_shape": stored.shape}
                raw = FileSource(stored.read, torch.uint8, stored.read.shape) if in_file else blocks
                self.residents[module_path] = ("gguf", {"weight": raw}, attributes)
                self.kept[name] = stored.qtype.name
                return
            tensor = dequantize(stored.read() if blocks is None else blocks, stored.qtype, stored.shape, target)
            why = self._why_float(module_path, attribute)
            tied = f" (tied: {', '.join(names[1:])} shares it)" if len(names) > 1 else ""
            self.dequantized[name] = f"dequantized from {stored.qtype.name}: {why}{tied}"
        elif stored.note is not None:  # values the mapping already had to dequantize (and transform)
            self.dequantized[name] = stored.note
            tensor = stored.read().to(target)
        else:
            if (stored.dtype != target and stored.dtype in _HALF_FLOATS
                    and self._keeps_gguf_storage(module_path, attribute)):
                # a GGUF F16/BF16 weight under a `gguf` rule stays in the file's storage, like a quantized one
                from ..quant.gguf_dequant import STORED_FLOATS

                qtype = next(qtype for qtype, dtype in STORED_FLOATS.items() if dtype == stored.dtype)
                attributes = {"gguf_qtype": qtype, "gguf_shape": stored.shape}
                nbytes = math.prod(stored.shape) * stored.dtype.itemsize
                raw = (FileSource(stored.read, torch.uint8, (nbytes,)) if in_file
                       else stored.read().view(torch.uint8).reshape(-1))
                self.residents[module_path] = ("gguf", {"weight": raw}, attributes)
                self.kept[name] = qtype.name
                return
            if stored.dtype != target and not (
                    self.dtype is not None and stored.dtype.is_floating_point and current.is_floating_point()):
                self.problem(
                    name, f"dtype {stored.dtype} in the file, {current.dtype} in the model (pass dtype= to convert)",
                )
                return
            tensor = FileSource(stored.read, target, stored.shape) if in_file else stored.read().to(target)
        self.tensors[name] = tensor
        self.aliases[name] = names

    def expands(self, planned) -> bool:
        """Whether a planned module is a resident (kept from the file, or quantized now) that expands its weight at a
        call on the CPU."""
        if planned.path in self.residents:
            format_name, _, attributes = self.residents[planned.path]
        elif planned.quant in FORMATS and FORMATS[planned.quant].quantizes_on_load:
            format_name, attributes = planned.quant, {protocol.GROUP_SIZE: planned.group_size}
        else:
            return False
        return not FORMATS[format_name].computes_directly({**attributes, protocol.ARITHMETIC: self.arithmetic},
                                                          torch.device("cpu"))

    def _keeps_gguf_storage(self, module_path: str, attribute: str) -> bool:
        """A Linear weight in a GGUF file that a `gguf` quant rule selects: it becomes a resident."""
        entry = self.plans.get(module_path)
        return (self.checkpoint.kind == "gguf" and attribute == "weight" and entry is not None and entry.quant == "gguf"
                and isinstance(self.model.get_submodule(module_path), nn.Linear))

    def _why_float(self, module_path: str, attribute: str) -> str:
        """Why a quantized GGUF tensor does not stay a resident, in words for the load report."""
        module = self.model.get_submodule(module_path)
        entry = self.plans.get(module_path)
        if attribute != "weight" or not isinstance(module, nn.Linear):
            return (f"`{attribute}` of a `{type(module).__name__}` module; GGUF residents hold Linear weights only "
                    "(other tensors compute in float)")
        if entry is None or entry.quant is None:
            return "no `gguf` quant rule of the policy selects this Linear layer"
        return f"the policy's quant rule `{entry.quant_rule}` gives this layer `{entry.quant}`, not `gguf`"

    def _comfy_quant(self, expected: dict[str, Tensor]) -> list[str]:
        """Layers stored pre-quantized under ComfyUI's `<layer>.comfy_quant` convention."""
        consumed = []
        for key, stored in self.checkpoint.tensors.items():
            if not key.endswith(comfy_quant.SUFFIX):
                continue
            prefix = key[: -len(comfy_quant.SUFFIX)]
            consumed.append(key)
            try:
                format_name, group = comfy_quant.decode(stored.read())
            except ValueError as exc:
                self.problem(key, str(exc))
                continue
            weight = self.checkpoint.tensors.get(f"{prefix}.weight")
            scale = self.checkpoint.tensors.get(f"{prefix}.weight_scale")
            current = expected.get(f"{prefix}.weight")
            if weight is None or scale is None or current is None:
                self.problem(key, "needs `.weight` and `.weight_scale` in the file and a Linear `.weight` in the model")
                continue
            rows = current.shape[0]
            if (weight.dtype != torch.int8 or weight.shape != tuple(current.shape)
                    or scale.shape not in ((rows,), (rows, 1))):
                self.problem(
                    f"{prefix}.weight",
                    f"an int8_tensorwise layer needs int8{list(current.shape)} and one scale per row",
                )
                continue
            if not isinstance(self.model.get_submodule(prefix), nn.Linear):
                self.problem(key, f"`{prefix}` is not a Linear layer")
                continue
            try:
                if group:
                    check_group_size(group, current.shape[1])
            except ValueError as exc:
                self.problem(key, str(exc))
                continue
            raw = (FileSource(weight.read, torch.int8, weight.shape) if isinstance(weight.read, FileRange)
                   else weight.read())
            stored_tensors = {"weight": raw, "weight_scale": scale.read().float().reshape(-1)}
            self.residents[prefix] = (format_name, stored_tensors, {protocol.GROUP_SIZE: group})
            consumed += [f"{prefix}.weight", f"{prefix}.weight_scale"]
        return consumed

    def units(self, plan) -> tuple[list[object], list[Unit]]:
        """What must be in memory (outside any streamed unit: buffers, relocated or transformed tensors, a tied one
        some holder of which streams in no unit), and each streamed unit's values, in the plan's order, with how its
        leaf reads its weight from the file (`row_reads`). Units sharing a tied tensor (an embedding and the head it
        is tied to) are one unit, in memory or in the file together."""
        units = {entry.path: Unit(entry.path, [], row_reads(entry.stream, self.model.get_submodule(entry.path)))
                 for entry in plan.modules if entry.stream}
        relocated = {(entry.path, name) for entry in plan.modules for name in entry.relocate}
        merged: dict[str, Unit] = dict(units)  # each leaf's unit, after merging
        must_hold: list[object] = []

        def unit_of(key: str) -> Unit | None:
            path = key.rpartition(".")[0]
            while True:
                if path in merged:
                    return merged[path]
                if not path:
                    return None
                path = path.rpartition(".")[0]

        for name, value in self.tensors.items():
            holders = [unit_of(alias) for alias in self.aliases[name]]
            if (None in holders or name in self.buffers
                    or any(alias.rpartition(".")[::2] in relocated for alias in self.aliases[name])):
                must_hold.append(value)
                continue
            unit = holders[0]
            for other in {id(h): h for h in holders[1:] if h is not unit}.values():  # tied: one unit from now on
                unit.values += other.values
                unit.also += (other.path, *other.also)
                unit.reads = _sharing(unit.reads, other.reads)
                other.values = []
                merged.update(dict.fromkeys((other.path, *other.also), unit))
            unit.values.append((name, value))
        for module_path, (_, stored, _) in self.residents.items():
            unit = unit_of(f"{module_path}.weight")
            for attribute, value in stored.items():
                if unit is None:
                    must_hold.append(value)
                else:
                    unit.values.append((f"{module_path}.{attribute}", value))
        return must_hold, [unit for unit in units.values() if unit.values]

    def read_in(self, tiers: Tiers) -> None:
        """Read every value that stays in memory (those left in the file stay `FileSource`s)."""
        self.sources = {key: value for key, value in self._values() if isinstance(value, FileSource)}
        keyed = [(key, value) for key, value in self.sources.items() if key not in tiers.in_file]
        for (key, _), tensor in zip(keyed, read_in([value for _, value in keyed], drop_cache=tiers.tight),
                                    strict=True):
            self._set_value(key, tensor)

    def _values(self):
        yield from self.tensors.items()
        for module_path, (_, stored, _) in self.residents.items():
            for attribute, value in stored.items():
                yield f"{module_path}.{attribute}", value

    def _set_value(self, key: str, value: object) -> None:
        if key in self.tensors:
            self.tensors[key] = value
            return
        module_path, _, attribute = key.rpartition(".")
        self.residents[module_path][1][attribute] = value

    def assign(self, progress: Callable[[int, int], None] | None, journal: Journal, file_tier: FileTier) -> None:
        """Put every value in the tree: tensors in memory as they are, those left in the file as meta placeholders;
        every value read from the file is recorded where it can be read back from (`protocol.SOURCES`)."""
        expected = self.model.state_dict(keep_vars=True)
        found: dict[str, dict[str, FileSource]] = {}
        total = len(self.tensors) + len(self.residents)
        for done, (name, tensor) in enumerate(self.tensors.items(), 1):
            if progress is not None:
                progress(done, total)
            current = expected[name]
            source = self.sources.get(name)  # a tied tensor's too: its holders leave it there together, one tensor
            if isinstance(tensor, FileSource):
                value = tensor.placeholder(current)
            elif isinstance(current, nn.Parameter):
                value = nn.Parameter(tensor, requires_grad=current.requires_grad)
            else:
                value = tensor
            for alias in self.aliases[name]:
                module_path, _, attribute = alias.rpartition(".")
                journal.set_tensor(self.model.get_submodule(module_path), attribute, value)
                if source is not None:
                    found.setdefault(module_path, {})[attribute] = source
        for done, (module_path, (format_name, stored, attributes)) in enumerate(self.residents.items(),
                                                                                len(self.tensors) + 1):
            held = {}
            for attribute, value in stored.items():
                if isinstance(value, FileSource):
                    value = value.placeholder(torch.empty(0))  # a plain meta tensor: the resident wraps it
                held[attribute] = value
                source = self.sources.get(f"{module_path}.{attribute}")
                if source is not None:
                    found.setdefault(module_path, {})[attribute] = source
            make_resident(self.model.get_submodule(module_path), format_name, held,
                          {**attributes, protocol.NAME: module_path}, journal)
            if progress is not None:
                progress(done, total)
        for module_path, tensors in found.items():
            journal.set_attributes(self.model.get_submodule(module_path),
                                   {protocol.SOURCES: Sources(file_tier, tensors)})
