"""`offload(model, policy, device=..., budget=...)`: low-VRAM inference without ComfyUI.

Streamed leaves keep their weights on the offload device (on CUDA, pinned in pieces of powers of two
that placing fills one at a time: `engine.stream.arena`). As many leaves as fit the budget, in registration
order (forward order for transformers models; leaves sharing a tied weight decide together), become
resident on the compute device and run the original forward; the others fetch their weights per
forward (on CUDA whole blocks decide, the streamed ones spread among the resident ones). The budget
counts streamed leaves only (a generic container with the descendants it claims): relocated and
unplanned tensors always live on the compute device. On CUDA the streamed weights go through the
streaming engine (`engine.stream`): a block's streamed leaves are one unit (a leaf on the file tier
its own), copied into a ring of device slots (counted in the budget) while the unit before it
computes. With offload and compute device both CPU everything still runs, fetching as plain torch does.

The arguments are checked before anything changes, and placing is atomic: on any failure (Ctrl-C
included) every tensor is moved back and the tree is as it was (converted only if it was before).
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ...errors import Error
from ...schemas import Policy
from ..checkpoint import tiers
from ..checkpoint.errors import CheckpointError
from ..compile import is_armed, lazy_compile
from ..convert import ConversionError, applied_state, apply_policy
from ..engine import file_tier, protocol, row_reads
from ..engine.exclusive import one_writer
from ..engine.file_reads import FileTier
from ..engine.journal import Journal
from ..engine.stream import on_host, placement
from ..engine.stream.device import device_ops
from ..engine.stream.measure import UnitClock
from ..engine.stream.on_host import StreamCosts
from ..engine.stream.streamer import Unit, UnitStreamer, fetcher_for
from ..plan.selectors import walk_modules, within
from ..policy.diagnostics import PolicyError
from ..quant.residents import device_expansion_bytes
from ..sizes import SizeError, human, parse_size
from .devices import weight_device

UNIT_SHARE = 0.5
"""A streamed unit (a leaf, or a generic container with what it claims) larger than this share of the budget (of
everything streamed, at budget 0) is warned of, the only unit too: it must fit on the device whole while it computes."""
AUTO_MARGIN = 0.10
"""The share of a device's total memory `budget="auto"` leaves free: for activations, the KV cache and the
allocator's slack."""
_SHARE = re.compile(r"\d+(\.\d*)?|\.\d+")
_log = logging.getLogger("streamwise.offload")


class OffloadError(Error, RuntimeError):
    """`offload` was given arguments it cannot place a tree with, or placing failed; the tree is unchanged."""


@dataclass(frozen=True)
class OffloadReport:
    device: str
    offload_device: str
    resident_modules: int
    streamed_modules: int
    resident_bytes: int
    streamed_bytes: int
    budget: int | None = None
    """The budget in bytes it was placed within (None: everything resident)."""
    large_units: tuple[tuple[str, int], ...] = ()
    """(path, bytes) of each streamed unit larger than `UNIT_SHARE` of the budget (of all streamed bytes at 0)."""
    file_bytes: int = 0
    """Of `streamed_bytes`, those read from their checkpoint file at each fetch (the file tier)."""
    host_budget: int | None = None
    """The host budget the tree was loaded under (None: host memory unlimited)."""
    pinned_bytes: int = 0
    """Of the host tier, the bytes pinned for asynchronous copies (CUDA); 0 where it stayed pageable, past the pinned
    budget (`engine.stream.arena.pinned_budget`), or where nothing streams from host memory."""
    host_blocks: int = 0
    """Streamed blocks that may compute on the host where their weights lie, input size by input size
    (`host_compute`, `engine.stream.on_host`)."""
    expansion_bytes: int = 0
    """The device buffer quantized weights are expanded into at a call, reused by every one of them and counted in
    the budget (`Fetcher.expansion`); 0 where none expands there or nothing streams through the ring."""
    measured: tuple[tuple[str, float], ...] = ()
    """(block, seconds) of each block's compute (a streamed leaf outside every block: its own) in the measuring
    forward (`measure`) the streamed blocks were spread along; empty where they were spread along their bytes."""

    def __str__(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {human(self.budget)}"
        line = (f"{budget} on {self.device}: {self.resident_modules} streamed leaves resident "
                f"({human(self.resident_bytes)}), {self.streamed_modules} stream from {self.offload_device} "
                f"({human(self.streamed_bytes)})")
        if self.file_bytes:
            line += (f", {human(self.file_bytes)} of them read from the file (host budget "
                     f"{human(self.host_budget or 0)})")
        if self.device.startswith("cuda") and self.streamed_bytes > self.file_bytes and not self.pinned_bytes:
            line += "; the host tier is pageable (past the pinned budget): its copies wait for the host"
        if self.expansion_bytes:
            line += f"; quantized weights expand into one {human(self.expansion_bytes)} buffer"
        if self.measured:
            line += (f"; streamed blocks spread along the compute of one measuring forward ({len(self.measured)} "
                     f"blocks, {sum(seconds for _, seconds in self.measured) * 1e3:.2f} ms, synchronised at each)")
        if self.host_blocks:
            line += f"; {self.host_blocks} blocks compute on the host where cheaper than their copy"
        if self.large_units:
            listed = ", ".join(f"`{path or '<root>'}` ({human(size)})" for path, size in self.large_units)
            line += f"; units larger than {UNIT_SHARE:.0%} of the budget: {listed}"
        return line


def offload(
    model: nn.Module,
    policy: Policy | str | Path,
    *,
    device: str | torch.device,
    budget: int | str | None = "auto",
    offload_device: str | torch.device = "cpu",
    prefetch: bool = True,
    host_compute: bool | StreamCosts = False,
    measure: Callable[[nn.Module], object] | None = None,
) -> OffloadReport:
    """Convert `model` by `policy` and stream it from `offload_device` to `device` within `budget`.

    `budget`: bytes, a size such as `"2GiB"` or `"1.5GB"`, a share of the device such as `"50%"`, `"auto"` (the
    device's free memory less `AUTO_MARGIN` of its total) or None (every streamed leaf resident). Tensors outside
    the plan are moved to the compute device; relocated ones follow it on their own. `prefetch` (CUDA only) streams by
    units through the engine's ring, each unit's copy overlapping the compute before it (False: each leaf copies
    its weights when it computes). `host_compute` (with `prefetch`, eager): a streamed block computes on the host,
    where its weights lie, for the input sizes where that costs less than copying it (decode steps, on a slow link),
    its costs measured (`StreamCosts` given: those figures); its numbers are then the host kernels', not the device's.
    `measure` (with `prefetch`, on an accelerator): a call running a typical forward, `measure(model)` (a prompt, a
    denoising step), run once while placing with every block streamed and the device synchronised at each, so the
    streamed blocks are then spread along the compute it timed rather than along their bytes (`placement.spread`);
    host work between the model's forwards is not counted. A model placed by a compiling policy is armed after
    placing, so its measuring forward is eager (one armed before runs `measure` twice, the first compiling).
    """
    device, offload_device = _usable(device, "device"), _usable(offload_device, "offload_device")
    budget = _budget(budget, device)

    def failed(exc: Exception) -> OffloadError | None:  # the errors that say what failed pass as they are
        if isinstance(exc, (ConversionError, PolicyError, OffloadError)):
            return None
        return OffloadError(f"placing the tree on {device} failed ({exc!r}); the tree was restored unchanged")

    with one_writer(model), Journal().atomic(failed) as journal:
        policy, plan = apply_policy(model, policy, journal=journal)
        state = applied_state(model)
        modules = dict(walk_modules(model))  # one walk, not a path lookup per leaf
        paths = [entry.path for entry in plan.modules if entry.stream]
        leaves = [modules[path] for path in paths]
        pin = device.type == "cuda" and offload_device.type == "cpu"  # copies from pinned memory may overlap compute
        ops = device_ops(device) if prefetch and offload_device.type == "cpu" else None
        resident_bytes = streamed_bytes = resident_count = file_bytes = 0
        host_budget = state.tree.host_budget
        in_blocks = _blocks(plan, modules)
        # the ring hides each copy behind the compute before it: streamed blocks are spread among resident ones
        blocks = {id(leaf): block or path for leaf, path, block in in_blocks} if ops is not None else None
        # quantized weights expanded at a call on the device go into one reused buffer, beside the ring
        expansion = device_expansion_bytes(leaves, device) if ops is not None else 0
        read: dict[int, Tensor] = {}  # what is read back from the file, by placeholder: tied ones once
        compute = None
        if measure is not None:
            room = None if budget is None else budget - expansion
            compute = _measured_compute(journal, model, state.tree, ops, device, in_blocks, modules, room, measure,
                                        read)
        placed = _residency(leaves, budget, blocks, compute)
        if device.type == "cpu" and host_budget is not None:  # the device budget is part of the host's
            staging = _slabs(state.tree) * max((size for _, size, _ in placed), default=0)
            room = max(0, host_budget - sum(t.nbytes for t in _outside_tensors(model, leaves)) - staging)
            if budget is None or budget > room:
                budget = room
                placed = _residency(leaves, budget, blocks, compute)
        if ops is not None and budget is not None:  # the ring of device slots lives within the budget
            ring = 0  # sized by the largest streamed unit, which a smaller room for residents may make larger
            while (needed := UnitStreamer.ring_bytes(_units(in_blocks, modules, placed, set())) + expansion) > ring:
                ring = needed
                placed = _residency(leaves, max(0, budget - ring), blocks, compute)
        in_file = _file_tier(model, placed, host_budget, device, leaves, _slabs(state.tree))
        host_tier = []
        for group, size, resident in placed:
            for leaf in group:
                for owner in _owners(leaf):
                    if id(leaf) in in_file:
                        file_tier.leave_in_file(journal, owner)
                    else:
                        _place(journal, owner, device if resident else offload_device, read)
                        host_tier += [] if resident else [owner]
                journal.keep(leaf, (protocol.FETCH_FLAG,))
                protocol.set_fetching(leaf, not resident)
            if resident:
                resident_bytes, resident_count = resident_bytes + size, resident_count + len(group)
            else:
                streamed_bytes += size
                file_bytes += size if id(group[0]) in in_file else 0
        if state.tree.file_tier is not None:
            state.tree.file_tier.forget()  # the forward order and what was read ahead belong to the old placing
        units = _units(in_blocks, modules, placed, in_file)
        streamer, pinned_bytes = fetcher_for(journal, ops, device, host_tier, units, pinned=pin,
                                             expansion=expansion)
        tier = state.tree.file_tier
        staged_for_ring = pin and isinstance(streamer, UnitStreamer) and streamer.staging
        if tier is not None and tier.pinned != staged_for_ring:  # the ring copies from the staging asynchronously
            journal.set_attributes(tier, {"pinned": staged_for_ring})
            tier.drop_staging()
        on_host.uninstall(journal, model)
        host_blocks = 0
        if host_compute is not False and isinstance(streamer, UnitStreamer):
            if policy.compile.enabled:
                _log.warning("offload: host_compute is off: policy `%s` compiles, and its graphs are traced for %s",
                             policy.name, device)
            else:
                costs = host_compute if isinstance(host_compute, StreamCosts) else StreamCosts()
                host_blocks = on_host.install(journal, streamer, costs)
        _place_outside(journal, model, leaves, device, read)
        journal.set_attributes(state.tree, {"compute_device": device, "fetcher": streamer})
        if policy.compile.enabled:
            _keep_arming(journal, model)
            lazy_compile(model, policy)
    report = OffloadReport(str(device), str(offload_device), resident_count, len(leaves) - resident_count,
                           resident_bytes, streamed_bytes, budget, _large_units(placed, paths, leaves, budget),
                           file_bytes, state.tree.host_budget, pinned_bytes, host_blocks,
                           expansion if isinstance(streamer, UnitStreamer) else 0,
                           tuple(compute.items()) if compute is not None else ())
    (_log.warning if report.large_units else _log.info)("offload: policy `%s`, %s", policy.name, report)
    return report


def _usable(device: str | torch.device, argument: str) -> torch.device:
    """`device` as a torch.device that exists here and can hold weights (an accelerator with its index)."""
    device = weight_device(device, f"{argument}={device!r}", OffloadError)
    if device.type == "cpu":
        return torch.device("cpu")  # as tensors report it: `cpu:0` would move every tensor onto itself
    backend = getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        raise OffloadError(f"{argument}={str(device)!r}: this torch ({torch.__version__}) has no usable "
                           f"{device.type} device here")
    count = backend.device_count()
    if device.index is None and hasattr(backend, "current_device"):
        device = torch.device(device.type, backend.current_device())  # compared with tensors' indexed devices
    if device.index is not None and device.index >= count:
        raise OffloadError(f"{argument}={str(device)!r}: there are {count} {device.type} device(s) here")
    return device


def _budget(budget: object, device: torch.device) -> int | None:
    """The budget in bytes: None (everything resident), bytes or a size string (`"2GiB"`, `"1.5GB"`), a share of
    the device (`"50%"` of its total memory) or `"auto"` (its free memory less `AUTO_MARGIN` of its total)."""
    if budget is None:
        return None
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        free, total = device_memory(device)
        return max(0, free - int(total * AUTO_MARGIN))
    if isinstance(budget, str) and budget.strip().endswith("%"):
        share = budget.strip()[:-1].strip()
        if not _SHARE.fullmatch(share) or not 0 <= float(share) <= 100:
            raise OffloadError(f"budget={budget!r}: a share of the device is a percentage from 0% to 100%")
        return int(device_memory(device)[1] * float(share) / 100)
    try:
        return parse_size(budget, "budget")
    except SizeError as exc:
        raise OffloadError(f"{exc}; or a share such as '50%', 'auto' or None (everything resident)") from None


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`'s memory: the accelerator's own count, the machine's memory for the CPU."""
    try:
        if device.type != "cpu":
            return getattr(torch, device.type).mem_get_info(device)
        try:
            import psutil
        except ImportError:  # the POSIX counts; free pages understate what the page cache would give back
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        memory = psutil.virtual_memory()
        return memory.available, memory.total
    except (AttributeError, ValueError, OSError, RuntimeError) as exc:
        raise OffloadError(f"cannot tell how much memory {device} has ({exc}): give the budget in bytes") from None


def _measured_compute(journal: Journal, model: nn.Module, tree, ops, device: torch.device,
                      in_blocks: list[tuple[nn.Module, str, str | None]], modules: dict[str, nn.Module],
                      room: int | None, measure: Callable[[nn.Module], object],
                      read: dict[int, Tensor]) -> dict[str, float] | None:
    """The compute in seconds of each block (by its path; a streamed leaf outside every block by its own), timed in
    the model's forwards while `measure(model)` runs, with every unit streamed through a ring of one slot (no
    prefetch) and the device synchronised at each unit's entry and copy (`UnitClock`; a model armed for compile runs
    it once before, untimed: that run compiles). A block partly on the file tier is a unit per leaf: their times add
    up to its own; a leaf reading its weight by rows is in no unit, its compute counted in the unit before it. None,
    said in the log, where nothing is to be spread (no ring, or everything resident within `room`, the budget less
    the expansion buffer). What the forward moved is journaled and moves back where the placing fails; what the file
    tier learnt of its order is forgotten. `read`: as for `file_tier.read_back`."""
    leaves = [leaf for leaf, _, _ in in_blocks]
    if ops is None or room is None or all(resident for _, _, resident in _residency(leaves, room)):
        why = f"nothing streams through a ring to {device}" if ops is None else "the budget holds every streamed leaf"
        _log.warning("offload: `measure` is not run: %s", why)
        return None
    all_streamed = [(group, 0, False) for group in _tied_groups(leaves)]  # `_units` reads only which stream
    on_file = {id(leaf) for leaf in leaves for owner in _owners(leaf) for t in owner._parameters.values()
               if t is not None and not file_tier.in_memory(t)}
    clock = UnitClock(ops)
    streamer = UnitStreamer(ops, device, _units(in_blocks, modules, all_streamed, on_file), slots=1, clock=clock)
    journal.set_attributes(tree, {"compute_device": device, "fetcher": streamer})
    for leaf in leaves:
        journal.keep(leaf, (protocol.FETCH_FLAG,))
        protocol.set_fetching(leaf, True)
    _place_outside(journal, model, leaves, device, read)
    for module in model.modules():  # relocated tensors follow the device by themselves: journaled here to go back
        for name in protocol.relocated_names(module):
            value = module._parameters.get(name, module._buffers.get(name))
            if value is not None and file_tier.in_memory(value) and value.device != device:
                journal.move(module, name, device)
    forward_done = model.register_forward_hook(lambda *_: streamer.timing.stop())  # host work between forwards
    try:
        with torch.no_grad():
            if is_armed(model):  # its first forward compiles the blocks' graphs, which is not what a forward costs
                measure(model)
                streamer.timing = clock = UnitClock(ops)
            measure(model)
    finally:
        forward_done.remove()
        if tree.file_tier is not None:
            tree.file_tier.forget()
    clock.stop()
    block_of = {path: block or path for _, path, block in in_blocks}
    compute: dict[str, float] = {}
    for unit in streamer.units:  # named by its block's path, or by its leaf's (outside blocks, or partly in the file)
        key = block_of.get(unit.name, unit.name)
        compute[key] = compute.get(key, 0.0) + clock.compute.get(unit.name, 0.0)
    _log.info("offload: the measuring forward computed %.2f ms across %d units and copied %.2f ms, synchronised at "
              "each", sum(clock.compute.values()) * 1e3, len(streamer.units), sum(clock.copies.values()) * 1e3)
    return compute


def _place_outside(journal: Journal, model: nn.Module, leaves: list[nn.Module], device: torch.device,
                   read: dict[int, Tensor] | None = None) -> None:
    """Place on `device` every module outside the streamed units (their owners), but those that relocate."""
    converted = {id(owner) for leaf in leaves for owner in _owners(leaf)}
    for module in model.modules():
        if id(module) not in converted and not protocol.relocated_names(module):
            _place(journal, module, device, read)


def _keep_arming(journal: Journal, model: nn.Module) -> None:
    """Arming writes the units' instance forwards and the root's compile state: restore them on failure."""

    journal.keep(model, (protocol.COMPILE_STATE,))
    for module in model.modules():
        journal.keep(module, ("forward",))


def _residency(leaves: list[nn.Module], budget: int | None, blocks: dict[int, str] | None = None,
               compute: dict[str, float] | None = None) -> list[tuple[list[nn.Module], int, bool]]:
    """(leaves, bytes, resident) per tied group, in registration order, resident within `budget` (None: everything).

    Without `blocks`, greedily in order, skipping groups that no longer fit. With `blocks` (each leaf's block, by
    leaf id), a block's groups decide together and the streamed blocks are spread among the resident ones along the
    forward's compute (`placement.spread`: each block's measured seconds in `compute`, by its name, where given; else
    its bytes), so each streamed block's copy overlaps the compute before it; what the spread leaves of the budget is
    filled in order."""
    sized = [(group, sum(t.nbytes for t in {id(p): p for leaf in group for owner in _owners(leaf)
                                            for p in owner._parameters.values() if p is not None}.values()))
             for group in _tied_groups(leaves)]
    if budget is None:
        return [(group, size, True) for group, size in sized]
    resident, used = [False] * len(sized), 0
    if blocks is not None:
        decisions: dict[str, list[int]] = {}  # a block's groups, in order
        for index, (group, _) in enumerate(sized):
            decisions.setdefault(blocks.get(id(group[0]), str(index)), []).append(index)
        sizes = [sum(sized[i][1] for i in indices) for indices in decisions.values()]
        for indices, size, kept in zip(decisions.values(), sizes, placement.spread(list(decisions), sizes, budget,
                                                                                   compute), strict=True):
            if kept:
                used += size
                for i in indices:
                    resident[i] = True
    for index, (_, size) in enumerate(sized):
        if not resident[index] and used + size <= budget:
            resident[index], used = True, used + size
    return [(group, size, chosen) for (group, size), chosen in zip(sized, resident, strict=True)]


def _large_units(placed: list[tuple[list[nn.Module], int, bool]], paths: list[str], leaves: list[nn.Module],
                 budget: int | None) -> tuple[tuple[str, int], ...]:
    """The units larger than `UNIT_SHARE` of the budget (of all streamed bytes at budget 0), by the path of their
    first leaf: each must fit on the device whole while it computes. The only unit is one too: at budget 0 it is all
    that streams, so it is always named (a whole model streamed as one unit, where no blocks were found)."""
    if budget is None or not placed:
        return ()
    limit = UNIT_SHARE * (budget or sum(size for _, size, _ in placed))
    path_of = {id(leaf): path for leaf, path in zip(leaves, paths, strict=True)}
    return tuple((path_of[id(group[0])], size) for group, size, _ in placed if size > limit)


def _slabs(tree) -> int:
    return tree.file_tier.slabs if tree.file_tier is not None else FileTier.SLABS


def _file_tier(model: nn.Module, placed: list[tuple[list[nn.Module], int, bool]], host_budget: int | None,
               device: torch.device, leaves: list[nn.Module], slabs: int) -> set[int]:
    """The ids of the streamed leaves whose units stay in their file, as a load places them (`tiers.place`): host
    memory holds what lives on the CPU outside streamed units and the resident units where the device is the CPU
    (its budget is part of the host's); of the streamed units that can be read back from their file, those that do
    not fit beside the staging buffers stay there."""
    if host_budget is None:
        return set()
    held = {id(t): t for t in _outside_tensors(model, leaves)} if device.type == "cpu" else {}
    shared = Counter(id(t) for leaf in leaves for owner in _owners(leaf) for t in owner._parameters.values())
    units = []
    for index, (group, _, resident) in enumerate(placed):
        tensors = [(owner, name, t) for leaf in group for owner in _owners(leaf)
                   for name, t in owner._parameters.items() if t is not None]
        if resident:
            held.update((id(t), t) for _, _, t in tensors if device.type == "cpu")
            continue
        # tied tensors once, and in memory: a placing keeps them there (only a load leaves one in the file)
        values = {id(t): (f"{index}.{position}", t if shared[id(t)] > 1 else file_tier.sources(owner).get(name, t))
                  for position, (owner, name, t) in enumerate(tensors)}
        if values:  # a leaf without parameters (a norm without affine ones) has nothing to place
            units.append(tiers.Unit(str(index), list(values.values())))
    budget = tiers.HostBudget(host_budget, f"{human(host_budget)}, the tree's (max_memory['cpu'] at its load)")
    try:
        placing = tiers.place("offload", held.values(), units, budget, slabs=slabs, doing="placing the tree")
    except CheckpointError as exc:
        raise OffloadError(str(exc)) from None
    return {id(leaf) for unit in units if unit.values[0][0] in placing.in_file
            for leaf in placed[int(unit.path)][0]}


def _outside_tensors(model: nn.Module, leaves: list[nn.Module]) -> list[Tensor]:
    """The tensors outside every streamed unit, each once: they live on the compute device whatever the budgets."""
    units = {id(owner) for leaf in leaves for owner in _owners(leaf)}
    return list({id(t): t for m in model.modules() if id(m) not in units
                 for t in (*m._parameters.values(), *m._buffers.values())
                 if t is not None and file_tier.in_memory(t)}.values())


def _owners(leaf: nn.Module) -> list[nn.Module]:
    """The modules whose parameters a streamed leaf fetches: itself, and what a generic container claims."""
    return [leaf, *protocol.claimed(leaf)]


def _tied_groups(leaves: list[nn.Module]) -> list[list[nn.Module]]:
    """Leaves in registration order, those sharing a parameter (tied embeddings) kept together."""
    groups: list[list[nn.Module]] = []
    owner: dict[int, list[nn.Module]] = {}
    for leaf in leaves:
        shared = next((owner[id(p)] for p in leaf.parameters(recurse=False) if id(p) in owner), None)
        group = shared if shared is not None else []
        if shared is None:
            groups.append(group)
        group.append(leaf)
        for parameter in leaf.parameters(recurse=False):
            owner[id(parameter)] = group
    return groups


def _place(journal: Journal, module: nn.Module, device: torch.device, read: dict[int, Tensor] | None = None) -> None:
    """Move a module's direct parameters and buffers in place; those it relocates (a generic streamed module's
    buffers) follow the compute device on their own. `read`: as for `file_tier.read_back`."""
    relocated = protocol.relocated_names(module)
    for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
        if tensor is None or name in relocated:
            continue
        if file_tier.on_file_tier(module, name):  # back from the file: read, then placed as any other
            journal.set_tensor(module, name, file_tier.read_back(module, name, read))
            tensor = module._parameters[name]
        if tensor.device != device:
            journal.move(module, name, device)


def _blocks(plan, modules: dict[str, nn.Module]) -> list[tuple[nn.Module, str, str | None]]:
    """Each streamed leaf, in the plan's order, with its path and the path of the block (the plan's compile unit) it
    lies in, None outside every block."""
    found, block = [], None
    for entry in plan.modules:
        if entry.compile_unit and not (block is not None and within(entry.path, block)):
            block = entry.path
        leaf = modules.get(entry.path)
        if entry.stream and leaf is not None:
            found.append((leaf, entry.path, block if block is not None and within(entry.path, block) else None))
    return found


def _units(in_blocks: list[tuple[nn.Module, str, str | None]], modules: dict[str, nn.Module],
           placed: list[tuple[list[nn.Module], int, bool]], in_file: set[int]) -> list[Unit]:
    """The streamed leaves grouped into units, in registration order: those of one block (`_blocks`) together where
    they are all held in host memory, any other leaf alone. A block with leaves on the file tier is a unit per leaf
    (their reads stage a leaf at a time, as the host budget counted, and each unit is entered once a forward, so the
    ring's order is one); a leaf that reads its weight by rows from the file (`row_reads`: an embedding's gathered
    rows, a head larger than the staging) is in none, as its forward never fetches it whole."""
    streamed = {id(leaf) for group, _, resident in placed if not resident for leaf in group}
    partly_in_file = {block for leaf, _, block in in_blocks if id(leaf) in in_file}
    grouped: dict[str, list[nn.Module]] = {}
    for leaf, path, block in in_blocks:
        by_rows = id(leaf) in in_file and row_reads.reading_by_rows(leaf, protocol.kind_of(leaf)) is not None
        if id(leaf) not in streamed or by_rows:
            continue
        grouped.setdefault(path if block is None or block in partly_in_file else block, []).append(leaf)
    blocks = {block for _, _, block in in_blocks}
    return [Unit(key, group, modules[key] if key in blocks else None) for key, group in grouped.items()]
