"""Stage 3's verb: `apply(plan, model)` converts a tree in place; `revert(model)` undoes it.

It stands above the stages it uses (the plan, the quant formats, the engine's leaf machinery) and imports them
plainly; the tree's state it records is the engine's (`engine.state`).

Invariants:
- checked in full before the first change (`check`); the heavy part (quantizing int8-family weights) runs
  before any module changes, so problems surface with the tree untouched;
- atomic: every change goes through a `Journal`, and any failure (Ctrl-C included) puts each one back exactly;
  an `Exception` surfaces as `ConversionError` (a PolicyError as it is), anything else (KeyboardInterrupt)
  unchanged; `revert` too: interrupted, the tree is converted as before, and the root state goes last;
- idempotent: applying the same plan again changes nothing and counts the same;
- no float tensor is copied: conversion swaps classes and sets a few plain attributes; only an int8-family quant
  rule replaces a layer's weight, with its quantized storage;
- reversible by `revert`, except once weights were quantized (their float values are gone);
- one writer per tree: `apply` and `revert` of one root (and `offload`, `load`, `dispatch`, which apply) run one at
  a time (`exclusive.one_writer`), so two threads leave it converted once or as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from torch import Tensor, nn

from ..engine import file_tier, protocol
from ..engine.exclusive import one_writer
from ..engine.journal import ABSENT, Journal, Record, swap_class
from ..engine.kinds import COMPUTE_KINDS, GENERIC, fit
from ..engine.probe import configuration, probe
from ..engine.relocating import relocating_class
from ..engine.streamed import claimed_below, holds_parameters_below, streaming_class
from ..plan.auto import plan_and_modules
from ..plan.selectors import class_names, walk_modules
from ..policy.diagnostics import PolicyError
from ..quant.formats import FORMATS
from ..quant.residents import make_resident
from .state import AppliedState, ConversionCounts, ConversionError, applied_state

if TYPE_CHECKING:
    from ...schemas import Policy
    from ..plan import ModulePlan, Plan


# The instance attributes a conversion may set, by role (and a host, later, on a streamed leaf): modules holding none
# of them before share one record per class they are converted to.
_MAY_SET = {
    "stream": (protocol.TREE, protocol.RELOCATED, protocol.CLAIMED, "weight", "bias", *protocol.LEAF_DEFAULTS),
    "relocate": (protocol.TREE, protocol.RELOCATED),
}


def apply(plan: Plan, model: nn.Module, *, journal: Journal | None = None) -> ConversionCounts:
    """Convert `model` as `plan` says, in place, and count the converted tree.

    With a `journal` (a caller's operation in progress, as `load` has), a failure also undoes what the
    caller journaled before.
    """
    return _apply(model, lambda: (plan, _located(plan, model)), journal or Journal())[1]


def apply_policy(
    model: nn.Module, policy: Policy | str | os.PathLike[str], *, dirs: Iterable[str | os.PathLike] = (),
    journal: Journal | None = None,
) -> tuple[Policy, Plan]:
    """Resolve `policy` (a Policy, a name or file to load, or `"auto"`) against `model` and convert it.

    Returns the loaded Policy and its Plan; raises PolicyError when the policy does not fit. One walk over the
    tree serves both steps: resolve hands over the modules its plan names. A `journal` is as for `apply`.
    """
    def planned() -> tuple[Plan, list[nn.Module]]:
        nonlocal policy  # the name or file becomes the loaded Policy
        policy, plan, modules = plan_and_modules(policy, model, dirs=dirs)
        return plan, modules

    plan, _ = _apply(model, planned, journal or Journal())
    return policy, plan


def check(plan: Plan, model: nn.Module) -> None:
    """Everything `apply` will change, checked without changing anything (raises ConversionError)."""
    _targets(plan, _located(plan, model), _converted_by(model))


def _located(plan: Plan, model: nn.Module) -> list[nn.Module]:
    """The module of `model` each entry of an ok plan names, in order (raises ConversionError)."""
    if not plan.ok:
        raise ConversionError("the plan has errors; fix the policy first:\n" + "\n".join(
            f"{d.severity}[{d.code}]: {d.message}" for d in plan.diagnostics if d.is_error
        ))
    modules = dict(walk_modules(model))
    located = []
    for entry in plan.modules:
        module = modules.get(entry.path)
        if module is None:
            raise ConversionError(f"the plan names `{entry.path}`, which this model does not have")
        located.append(module)
    return located


def _apply(
    model: nn.Module, planned: Callable[[], tuple[Plan, list]], journal: Journal
) -> tuple[Plan, ConversionCounts]:
    """Convert `model` by the plan `planned()` gives, with the module of each entry, all or nothing."""
    with one_writer(model):  # read the state under the lock: another thread may be converting the tree
        state = applied_state(model) or AppliedState()
        tree = state.tree
        step, converting = "checking", None  # where a failure happened: the step, and the entry being converted

        def failed(exc: Exception) -> ConversionError | None:
            if isinstance(exc, (ConversionError, PolicyError)):  # they say what failed
                return None
            where = f"{step} `{converting.path}`" if converting is not None else step
            return ConversionError(f"{where} failed ({exc!r}); the tree was restored unchanged")

        with journal.atomic(failed):
            plan, located = planned()
            targets = _targets(plan, located, _converted_by(model))
            step = "quantizing"
            quantized = _quantized(plan, located)  # the heavy part, before anything changes
            records: list[Record] = []
            shared: dict[type, Record] = {}  # by new class: the record modules converted to it alike join
            step = "converting"
            for entry, module, cls in zip(plan.modules, located, targets, strict=True):
                if cls is None or type(module) is cls:
                    if entry.quant and protocol.is_resident(module) and protocol.tree_of(module) is None:
                        journal.set_attributes(module, {protocol.TREE: tree})  # a resident a checkpoint load made
                    continue
                converting = entry
                role = "stream" if entry.stream else "relocate"
                attributes = protocol.leaf_attributes(module, tree) if entry.stream else {protocol.TREE: tree}
                if entry.relocate:
                    attributes[protocol.RELOCATED] = entry.relocate
                if entry.stream == GENERIC and holds_parameters_below(module):
                    attributes[protocol.CLAIMED] = claimed_below(module)
                alike = shared.get(cls)
                record = swap_class(module, cls, attributes, role, clears=_MAY_SET[role], root=module is model,
                                    alike=alike)
                if record is not alike:
                    records.append(journal.add(record))
                    if type(record.replaced) is tuple and module is not model:
                        shared[cls] = record  # the modules converted to `cls` next join it
            step, converting = "making quantized residents", None
            for entry, module, stored in quantized:
                make_resident(module, entry.quant, stored,
                              {protocol.GROUP_SIZE: entry.group_size, protocol.NAME: entry.path}, journal, tree)
            step = "recording the conversion"
            journal.set_attributes(state, {"records": state.records + records, "plan": plan})
            journal.set_attributes(model, {protocol.STATE: state})
        return plan, state.counts()


def revert(model: nn.Module) -> None:
    """Restore the original classes and attributes of a converted tree (tensors stay where they are).

    Atomic: interrupted, the tree is converted as before (and can be reverted again).
    """
    with one_writer(model):
        state = applied_state(model)
        if state is None:
            raise ConversionError("this model was not converted by streamwise.apply")
        if any(protocol.is_resident(m) for m in model.modules()):
            raise ConversionError(
                "the tree holds quantized residents, whose float weights are gone; reload the model instead"
            )
        in_file = next((path for path, m in model.named_modules() if file_tier.in_file(m)), None)
        if in_file is not None:  # unconverted, nothing would read it back
            raise ConversionError(f"`{in_file or '<root>'}` holds weights left in their file (the file tier); read "
                                  "them back first (offload with a host budget that holds them) or reload the model")
        journal = Journal()
        with journal.atomic(lambda exc: ConversionError(f"reverting failed ({exc!r}); the tree is converted as "
                                                        "before")):
            for record in reversed(state.records):
                journal.restore(record)
            journal.restore(Record([model], type(model), {protocol.STATE: ABSENT}, ""))  # the root state goes last


def _quantized(plan: Plan, located: list[nn.Module]) -> list[tuple[ModulePlan, nn.Module, dict[str, Tensor]]]:
    """The quantized tensors for the plan's int8-family layers, computed without changing the tree.

    GGUF residents come from GGUF files (`streamwise.load`); a `gguf` rule on float weights keeps the floats.
    """
    on_load = {name: handler for name, handler in FORMATS.items() if handler.quantizes_on_load}
    quantized = []
    for entry, module in zip(plan.modules, located, strict=True):
        if entry.quant in on_load and not protocol.is_resident(module):
            weight = module.weight.detach()
            quantized.append((entry, module, on_load[entry.quant].quantize(weight, entry.group_size)))
    return quantized


def _converted_by(model: nn.Module) -> str | None:
    """The policy `model` was converted by before, if it was."""
    state = applied_state(model)
    return state.plan.policy if state is not None and state.plan is not None else None


def _targets(plan: Plan, located: list[nn.Module], converted_by: str | None) -> list[type | None]:
    """The class each module an ok plan names must end up with (None: the plan converts it not); checks everything
    first (`converted_by`: the policy the tree was converted by before, for messages).

    What depends on the class alone (which class the plan expects, the derived class) is decided once per class.
    """
    by_class: dict[tuple, tuple[type, frozenset | None, bool]] = {}
    probed: set[tuple] = set()  # (class key, configuration) of the unproven modules found to compute alike
    targets: list[type | None] = []
    for entry, module in zip(plan.modules, located, strict=True):
        if not (entry.stream or entry.relocate):
            targets.append(None)
            continue
        key = (type(module), entry.class_name, entry.stream, bool(entry.relocate))
        decided = by_class.get(key)
        if decided is None:
            decided = by_class[key] = _target_class(entry, module, plan.policy, converted_by)
        target, needs, unproven = decided
        if needs is not None and ("forward" in module.__dict__ or not needs <= module._parameters.keys()):
            _check_leaf(entry, module)  # the rare case, explained
        if unproven:  # one probe per distinct configuration of the class's modules
            seen = (key, configuration(COMPUTE_KINDS[entry.stream], module))
            if seen not in probed and _probed(plan, entry, module):
                probed.add(seen)
        targets.append(target)
    return targets


def _target_class(entry: ModulePlan, module: nn.Module, policy: str, converted_by: str | None
                  ) -> tuple[type, frozenset[str] | None, bool]:
    """The class every module of `module`'s class must end up with under `entry`; what a streamed leaf of that
    class must hold as parameters to be known fine without a closer look (None: nothing to check per module); and
    whether its kind must be probed (not proven for the class)."""
    cls = type(module)
    if protocol.is_resident(module):
        return cls, None, False  # a quantized resident already streams
    original = protocol.original_class(cls)
    seen = class_names(original)[0].qualified
    if seen != entry.class_name:
        raise ConversionError(f"`{entry.path}` is a {seen}, but the plan was resolved for a {entry.class_name}")
    if entry.stream:
        target = streaming_class(original, entry.stream, relocating=bool(entry.relocate))
    else:
        target = relocating_class(original)
    if cls is target:
        return target, None, False  # converted before: applying again changes nothing
    if cls is not original:
        before = f"policy `{converted_by}`" if converted_by else "another conversion"
        now, asked = protocol.kind_of(module) or "relocating", entry.stream or "relocating"
        raise ConversionError(
            f"`{entry.path or '<root>'}` ({original.__name__}) was already converted differently: {now} "
            f"({cls.__name__}) by {before}, where policy `{policy}` asks for {asked}. Convert a copy of the "
            f"unconverted model (the ComfyUI Apply node does), or reload it")
    if not entry.stream:
        return target, None, False
    # a plan keeps a specific kind for a class it is not proven for only where the rule named the class exactly
    fits = fit(entry.stream, original, named=True)
    if fits.refused is not None:
        raise ConversionError(f"`{entry.path}`: {fits.refused}")
    return target, fits.needs, not fits.proven


def _probed(plan: Plan, entry: ModulePlan, module: nn.Module) -> bool:
    """Probe `module` (its kind is not proven for its class): raise if the kind computes otherwise; whether the
    probe could run (the weights hold data)."""
    weight = module._parameters.get("weight")
    if weight is None or not file_tier.in_memory(weight):
        return False
    problem = probe(COMPUTE_KINDS[entry.stream], module)
    if problem is not None:
        raise ConversionError(
            f"stream rule `{entry.stream_rule}` of policy `{plan.policy}` computes `{entry.path}` "
            f"({protocol.original_class(type(module)).__name__}) as `{entry.stream}`, which does not reproduce the "
            f"class: {problem}; use `kind = \"auto\"` or `kind = \"generic\"`"
        )
    return True


def _check_leaf(entry: ModulePlan, module: nn.Module) -> None:
    """What a streamed leaf needs of its instance: no forward of its own, the attributes its kind reads."""
    if "forward" in module.__dict__:
        raise ConversionError(f"`{entry.path}` has a forward of its own (a hook installs these), which would "
                              "bypass streaming; remove the hook or exclude the module from the policy")
    missing = COMPUTE_KINDS[entry.stream].missing(module)
    if missing:
        raise ConversionError(f"`{entry.path}` ({protocol.original_class(type(module)).__name__}) cannot compute "
                              f"as `{entry.stream}`: it has no {', '.join(missing)}")
