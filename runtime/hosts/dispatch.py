"""`dispatch(model, policy, max_memory=...)`: several devices through accelerate, streaming inside each share.

accelerate places a model across devices from a device map (`dispatch_model`); Streamwise knows the model's
blocks (the policy's compile units), its streamed leaves and their bytes. `infer_device_map` turns a Plan and a
budget per device into that map: whole blocks (and accelerate's `_no_split_modules`) per accelerator, in order,
tied weights on one device, and what fits no accelerator in the `"cpu"` entry, bounded by its budget. Those
modules are not accelerate's to offload: their leaves stay in CPU memory (pinned pieces) and Streamwise streams
them to the device their inputs arrive on, which is the last accelerator for the tail the greedy fill leaves over:
each entry's streamed leaves are one unit of the streaming engine (`engine.stream`), copied ahead through its ring
of device slots, for which that accelerator keeps room.

`dispatch` applies the policy, places every tensor in place (the same Parameter objects, so tied weights stay
tied and a failure moves them back), and attaches accelerate's own device hooks to the accelerator shares and the
root, as `dispatch_model` does for the entries it does not offload. `dispatch_model` itself would offload the
`"cpu"` entry with its hooks (parameters to meta, copied per forward), replacing Streamwise's streaming.

accelerate is an optional extra (`pip install streamwise[accelerate]`): this module imports it on first use.
`infer_device_map` needs it only to read the free memory when no budgets are given: it finds the atoms, their
sizes and the tied parameters in one walk of the tree, which is what makes it faster than accelerate's own
`infer_auto_device_map` on the same tree (accelerate walks it once per question).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...errors import Error
from ...schemas import Policy
from ..convert import ConversionError, applied_state, apply_policy
from ..engine import file_tier, protocol
from ..engine.exclusive import one_writer
from ..engine.journal import Journal
from ..engine.stream.device import device_ops
from ..engine.stream.streamer import Unit, UnitStreamer, fetcher_for
from ..plan import Plan, plan_for
from ..plan.selectors import joined
from ..policy.diagnostics import PolicyError
from ..sizes import SizeError, parse_size
from .devices import weight_device

CPU = "cpu"
DISK = "disk"
"""accelerate's name for weights offloaded to disk: here, streamed leaves left in the checkpoint they were loaded
from (the file tier, `engine.file_tier`), read at each forward."""
_HOOK_ATTRIBUTES = ("_hf_hook", "_old_forward", "forward")  # what accelerate's add_hook_to_module sets


class DispatchError(Error, RuntimeError):
    """`dispatch` or `infer_device_map` was given budgets or devices it cannot place a tree with, or placing
    failed; the tree is unchanged."""


@dataclass(frozen=True)
class DispatchReport:
    device_map: dict[str, str]
    """The map accelerate's `dispatch_model` takes (also set as `model.hf_device_map`)."""
    bytes: dict[str, int]
    """Bytes of parameters and buffers per device (tied ones counted once)."""
    streamed_modules: int
    """Streamed leaves in the `"cpu"` and `"disk"` entries: Streamwise fetches them per forward."""
    resident_modules: int
    """Streamed leaves on an accelerator: resident, computing with the original forward."""


def _accelerate():
    """accelerate, or a DispatchError saying what to install."""
    try:
        import accelerate
        import accelerate.hooks
        import accelerate.utils
    except ModuleNotFoundError as missing:
        if (missing.name or "").split(".")[0] != "accelerate":
            raise
        raise DispatchError("several devices go through accelerate, which is not installed: "
                            "pip install 'streamwise[accelerate]' (or pip install 'accelerate>=1.0')") from None
    return accelerate


def budgets(max_memory: Mapping | None) -> dict[str, int]:
    """`max_memory` as {device: bytes}, accelerators in the order given, then `"cpu"`.

    Keys: "cpu", an accelerator ("cuda:1", a torch.device, or an index as accelerate takes it); values: bytes,
    or sizes with accelerate's units ("20GiB", "1.5GB": `runtime/sizes.py`). None: accelerate's
    `get_max_memory()`, the free memory of every device here. `"disk"` (any size: the checkpoint is the disk) lets
    what fits no device stay in the file the tree was loaded from.
    """
    if max_memory is None:
        max_memory = _accelerate().utils.get_max_memory()
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise DispatchError(f"max_memory={max_memory!r}: a mapping of devices to budgets is expected, such as "
                            '{"cuda:0": "20GiB", "cuda:1": "20GiB", "cpu": "64GiB"}')
    parsed: dict[str, int] = {}
    for key, value in max_memory.items():
        device = _device_name(key)
        if device in parsed:
            raise DispatchError(f"max_memory names {device!r} twice (as {key!r})")
        parsed[device] = _bytes(value, device)
    cpu, disk = parsed.pop(CPU, 0), parsed.pop(DISK, None)
    return {**parsed, CPU: cpu, **({DISK: disk} if disk is not None else {})}


def _device_name(key: object) -> str:
    if isinstance(key, bool):
        raise DispatchError(f"max_memory key {key!r} is not a device")
    if isinstance(key, int):  # accelerate's spelling of an accelerator index
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        key = torch.device(accelerator.type if accelerator is not None else "cuda", key)
    if key == DISK:
        return DISK
    if key == "meta":
        raise DispatchError(f"max_memory key {key!r}: weights on meta would not be there to stream (give the CPU "
                            "a budget, or \"disk\" to leave them in their file)")
    device = weight_device(key, f"max_memory key {key!r}", DispatchError)
    if device.type == CPU:
        return CPU
    return str(torch.device(device.type, 0 if device.index is None else device.index))


def _bytes(value: object, device: str) -> int:
    try:
        return parse_size(value, f"max_memory[{device!r}]")
    except SizeError as exc:
        raise DispatchError(str(exc)) from None


def infer_device_map(model: nn.Module, plan: Plan | Policy | str | Path, max_memory: Mapping | None) -> dict[str, str]:
    """The device map for `model` under `plan` (or a policy, resolved here) within `max_memory`; pure (works on meta).

    Atoms: the compile blocks, accelerate's `_no_split_modules`, streamed entries, and whatever subtree holds none
    of them; containers above them are split (their direct tensors become `path.name` entries). Atoms sharing a
    parameter (tied weights) form one unit, placed where its first atom goes. Units fill the accelerators greedily
    in registration order (forward order for transformers models), moving to the next accelerator when one is full;
    the rest go to `"cpu"`, which may hold only what Streamwise streams (a tensor outside every streamed entry goes
    to the accelerator with most room left). The last accelerator keeps room for the ring the `"cpu"` entries stream
    through (`UnitStreamer.SLOTS` times the largest entry's streamed bytes). Sizes count a tensor held at several
    paths at the first, as accelerate's `compute_module_sizes` does (in bytes, where accelerate counts bool tensors
    in bits).
    """
    if not isinstance(plan, Plan):
        _, plan = plan_for(plan, model)
    limits = budgets(max_memory)
    accelerators = [device for device in limits if device not in (CPU, DISK)]
    atoms = _Atoms(model, plan)
    reserve = 0
    while True:
        placement = _fill(atoms.units, atoms.sizes, atoms.movable, accelerators, limits, reserve)
        fetched: dict[str, int] = {}  # by "cpu" or "disk" entry: the bytes its streamed leaves fetch
        for path in atoms.streamed:
            entry = _entry_of(path, placement)
            if entry is not None and placement[entry] in (CPU, DISK):
                fetched[entry] = fetched.get(entry, 0) + atoms.sizes[path]
        need = UnitStreamer.SLOTS * max(fetched.values(), default=0)  # the ring they stream through
        if not accelerators or need <= reserve:
            return placement
        reserve = need  # only grows, and the cpu entry with it: this ends


def _entry_of(path: str, placement: dict[str, str]) -> str | None:
    """The device map's entry holding `path` (None: none does)."""
    while True:
        if path in placement:
            return path
        if not path:
            return None
        path = path.rpartition(".")[0]


class _Atoms:
    """What a device map places, from one walk over the tree: the atoms in registration order grouped into units
    (atoms sharing a parameter together), the bytes of each atom and each streamed entry, and whether all an atom
    holds is what Streamwise streams (parameters of streamed entries, buffers of generic ones)."""

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        blocks = {entry.path for entry in plan.modules if entry.compile_unit}
        self.streamed = [entry.path for entry in plan.modules if entry.stream]
        self._streams = set(self.streamed)
        self._generic = {entry.path for entry in plan.modules if entry.stream == "generic"}
        self._whole = blocks | self._streams
        self._holding = {""}  # paths at or above an atom that must stay whole
        for path in self._whole:
            while path:
                path = path.rpartition(".")[0]
                self._holding.add(path)
        self._no_split = set(getattr(model, "_no_split_modules", None) or ())
        self.sizes: dict[str, int] = {}
        self.movable: dict[str, bool] = {}
        self._owners: dict[int, list[str]] = {}  # parameter -> the atoms holding it
        self._seen: set[int] = set()
        self._walk(model, "", None, False, False)
        self.units = self._tied_units()

    def _walk(self, module: nn.Module, path: str, atom: str | None, streamed: bool, generic: bool) -> int:
        """Bytes first met in `module`'s subtree; `atom` is the one its tensors belong to (None above atoms)."""
        streamed, generic = streamed or path in self._streams, generic or path in self._generic
        if atom is None and (path not in self._holding or path in self._whole
                             or type(module).__name__ in self._no_split):
            atom = path
        total = 0
        for tensors, follows in ((module._parameters, streamed), (module._buffers, generic)):
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                owner = joined(path, name) if atom is None else atom  # a split container's tensor is an atom
                self.movable[owner] = self.movable.get(owner, True) and follows
                if id(tensor) not in self._seen:
                    self._seen.add(id(tensor))
                    total += tensor.nbytes
                    self.sizes[owner] = self.sizes.get(owner, 0) + tensor.nbytes
                if tensors is module._parameters:
                    self._owners.setdefault(id(tensor), []).append(owner)
        for name, child in module._modules.items():
            if child is not None:
                total += self._walk(child, joined(path, name), atom, streamed, generic)
        if path in self._streams:
            self.sizes[path] = total
        return total

    def _tied_units(self) -> list[list[str]]:
        order = {atom: index for index, atom in enumerate(self.movable)}  # atoms in registration order
        group: dict[str, list[str]] = {atom: [atom] for atom in order}
        for owners in self._owners.values():
            members = dict.fromkeys(owners)
            if len(members) > 1:
                merged = sorted({atom for member in members for atom in group[member]}, key=order.__getitem__)
                for atom in merged:
                    group[atom] = merged
        units, seen = [], set()
        for atom in order:
            if atom not in seen:
                units.append(group[atom])
                seen.update(group[atom])
        return units


def _fill(units, sizes, movable, accelerators, limits, reserve) -> dict[str, str]:
    used = dict.fromkeys(limits, 0)
    room = {device: limits[device] for device in accelerators}
    if accelerators:
        room[accelerators[-1]] = max(0, room[accelerators[-1]] - reserve)
    placement: dict[str, str] = {}
    current = 0
    for unit in units:
        size = sum(sizes.get(atom, 0) for atom in unit)
        while current < len(accelerators) and used[accelerators[current]] + size > room[accelerators[current]]:
            current += 1
        if current < len(accelerators):
            device = accelerators[current]
        elif not accelerators or all(movable[atom] for atom in unit):
            device = CPU
            if used[CPU] + size > limits[CPU] and DISK in limits and all(movable[atom] for atom in unit):
                device = DISK  # left in its file: `dispatch` checks it was loaded from one
            elif used[CPU] + size > limits[CPU]:
                raise DispatchError(
                    f"{unit[0]!r} ({size} bytes) fits no device: the accelerators are full and the cpu entry "
                    f"holds {used[CPU]} of its {limits[CPU]} bytes; raise max_memory")
        else:  # tensors Streamwise does not stream: on the accelerator with most room left
            device = max(accelerators, key=lambda d: room[d] - used[d])
            if used[device] + size > room[device]:
                raise DispatchError(
                    f"{unit[0]!r} ({size} bytes) holds tensors no streamed leaf holds, so it must live on an "
                    f"accelerator, and none has {size} bytes left; raise max_memory")
        used[device] += size
        placement.update(dict.fromkeys(unit, device))
    return placement


def dispatch(
    model: nn.Module,
    policy: Policy | str | Path,
    *,
    max_memory: Mapping | None = None,
) -> DispatchReport:
    """Convert `model` by `policy`, place it across the devices of `max_memory` and attach accelerate's hooks.

    Accelerator shares are resident on their device (accelerate moves inputs between them); the `"cpu"` entry
    streams through Streamwise onto the device its inputs come from. Budgets and devices are checked before
    anything changes; on any failure the tree is as it was.
    """
    accelerate = _accelerate()
    limits = budgets(max_memory)
    accelerators = [torch.device(device) for device in limits if device not in (CPU, DISK)]
    for device in accelerators:
        _check_present(device)
    main = accelerators[0] if accelerators else torch.device(CPU)
    tail = accelerators[-1] if accelerators else main  # where the "cpu" entries compute: their inputs arrive there
    ops = device_ops(tail)  # CUDA: each "cpu" entry's streamed leaves are one unit through the engine's ring there

    def failed(exc: Exception) -> Exception | None:
        if isinstance(exc, (ConversionError, PolicyError, DispatchError)):
            return None
        return DispatchError(f"dispatching the tree failed ({exc!r}); the tree was restored unchanged")

    with one_writer(model), Journal().atomic(failed) as journal:
        policy, plan = apply_policy(model, policy, journal=journal)
        device_map = infer_device_map(model, plan, limits)
        state = applied_state(model)
        leaves = {entry.path for entry in plan.modules if entry.stream}
        streamed = resident = 0
        placed_bytes = dict.fromkeys(limits, 0)
        seen: set[int] = set()
        read: dict[int, torch.Tensor] = {}  # what is read back from the file, by placeholder: tied ones once
        made: dict[int, torch.Tensor] = {}  # what is left there, by the tensor: tied ones one placeholder
        host_tier: list[nn.Module] = []  # the modules of the "cpu" entries, in order
        units: list[Unit] = []  # the streamed leaves of each "cpu" entry
        for atom, device in device_map.items():
            on_cpu = device in (CPU, DISK)
            target = torch.device(CPU if device == DISK else device)
            owner, slot = _target(model, atom)
            modules = [owner] if slot is not None else list(owner.modules())
            for module in modules:
                if device == DISK:
                    _leave_in_file(journal, atom, module, made)
                if not on_cpu and protocol.relocated_names(module):  # accelerate places them: keep them there
                    journal.set_attributes(module, {protocol.RELOCATED: ()})
                relocated = protocol.relocated_names(module)
                for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                    if tensor is None or (slot is not None and name != slot):
                        continue
                    if id(tensor) not in seen:
                        seen.add(id(tensor))
                        placed_bytes[device] += tensor.nbytes
                    if name in relocated or device == DISK:
                        continue
                    if file_tier.on_file_tier(module, name):  # back from the file, then placed as any other
                        journal.set_tensor(module, name, file_tier.read_back(module, name, read))
                        tensor = module._parameters[name]
                    if tensor.device != target:
                        journal.move(module, name, target)
            host_tier += modules if device == CPU else []
            prefix = f"{atom}." if atom else ""
            for path in leaves:
                if path == atom or path.startswith(prefix):
                    leaf = model.get_submodule(path)
                    journal.keep(leaf, (protocol.FETCH_FLAG,))
                    protocol.set_fetching(leaf, on_cpu)
                    streamed, resident = streamed + on_cpu, resident + (not on_cpu)
            unit = [module for module in modules if protocol.kind_of(module)] if device == CPU else []
            units += [Unit(atom, unit, owner if slot is None else None)] if unit else []  # the region's order
        fetcher, _ = fetcher_for(journal, ops, tail, host_tier, units, pinned=tail.type == "cuda")
        journal.set_attributes(state.tree, {"compute_device": main, "fetcher": fetcher})
        for module in model.modules():
            journal.keep(module, _HOOK_ATTRIBUTES)
        journal.keep(model, ("hf_device_map",))
        execution = {atom: device for atom, device in device_map.items() if device not in (CPU, DISK)}
        accelerate.hooks.attach_align_device_hook_on_blocks(
            model, execution_device={**execution, "": main}, offload=dict.fromkeys(execution, False),
            skip_keys=getattr(model, "_skip_keys_device_placement", None))
        model.hf_device_map = dict(device_map)
    return DispatchReport(dict(device_map), placed_bytes, streamed, resident)


def _leave_in_file(journal: Journal, atom: str, module: nn.Module, made: dict[int, torch.Tensor]) -> None:
    """A module of a `"disk"` entry: its parameters back in their file, or a DispatchError where one has none."""
    missing = [name for name, tensor in module._parameters.items()
               if tensor is not None and name not in file_tier.sources(module)]
    if missing:
        raise DispatchError(f"{atom!r} goes to \"disk\" but its `{missing[0]}` was not loaded from a file it can be "
                            "read back from: load the model with streamwise.load or load_pretrained, or raise the "
                            "cpu budget")
    file_tier.leave_in_file(journal, module, made)


def _target(model: nn.Module, atom: str) -> tuple[nn.Module, str | None]:
    """The module an entry names, or (its owner, the tensor's name) for a `path.name` tensor entry."""
    try:
        return model.get_submodule(atom), None
    except AttributeError:
        path, _, name = atom.rpartition(".")
        return model.get_submodule(path), name


def _check_present(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise DispatchError(f"max_memory names {str(device)!r}: this torch ({torch.__version__}) has no usable "
                            f"{device.type} device here")
    count = backend.device_count()
    if device.index >= count:
        raise DispatchError(f"max_memory names {str(device)!r}: there are {count} {device.type} device(s) here")
