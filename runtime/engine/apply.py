"""`apply(plan, model)` converts a tree in place; `revert(model)` undoes it.

Conversion swaps classes and adds a few plain attributes: no tensor is copied or moved, so it
works on meta tensors and costs nothing in memory. It is checked in full before the first
change, atomic (a failure midway restores every module exactly), idempotent (applying the same
plan again changes nothing and reports the same census) and reversible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from .kinds import COMPUTE_KINDS
from ..plan.plan import ModulePlan, Plan
from .relocating import relocating_class
from ..plan.selectors import ModuleRef
from .streamed import streaming_class
from .tree import StreamTree

if TYPE_CHECKING:
    from ...schemas import Policy

STATE_ATTRIBUTE = "_streamwise"


class ConversionError(RuntimeError):
    """A plan could not be applied to a tree; the tree is unchanged."""


@dataclass(frozen=True)
class ConversionCounts:
    """What a converted tree holds: streamed leaves per compute kind and relocating modules."""

    streamed: dict[str, int]
    relocating: int


_ABSENT = object()


@dataclass
class _Record:
    module: nn.Module
    original_class: type
    replaced: dict[str, object]  # each attribute set, and what the instance held before (_ABSENT: nothing)
    role: str  # "stream", "relocate" or "host" (a host's adaptation of the root, see hosts/)


@dataclass
class AppliedState:
    """Kept on the root module: the tree's streaming state and how to undo the conversion."""

    tree: StreamTree = field(default_factory=StreamTree)
    records: list[_Record] = field(default_factory=list)
    plan: Plan | None = None

    def census(self) -> ConversionCounts:
        streamed: dict[str, int] = {}
        relocating = 0
        for record in self.records:
            if record.role == "stream":
                kind = type(record.module)._sw_kind
                streamed[kind] = streamed.get(kind, 0) + 1
            relocating += record.role == "relocate"
        return ConversionCounts(dict(sorted(streamed.items())), relocating)


def applied_state(model: nn.Module) -> AppliedState | None:
    return model.__dict__.get(STATE_ATTRIBUTE)


def apply(plan: Plan, model: nn.Module) -> ConversionCounts:
    """Convert `model` as `plan` says, in place, and return the census of the converted tree."""
    targets = check(plan, model)
    state = applied_state(model) or AppliedState()
    changes = [(entry, module, cls) for entry, (module, cls) in targets if type(module) is not cls]
    done: list[_Record] = []
    path = ""
    try:
        quantized = _quantized(plan, model)  # the heavy part, before anything changes
        for entry, module, cls in changes:
            path = entry.path
            done.append(_convert(module, cls, entry, state.tree))
    except BaseException as exc:
        for record in reversed(done):
            _restore(record)
        step = f"converting `{path}`" if path else "quantizing"
        raise ConversionError(f"{step} failed ({exc!r}); the tree was restored unchanged") from exc
    state.records += done
    state.plan = plan
    model.__dict__[STATE_ATTRIBUTE] = state
    from ..quant.residents import make_resident

    for entry, module, stored in quantized:
        make_resident(module, entry.quant, stored, {"_sw_group_size": entry.group_size})
    for module in model.modules():
        if hasattr(type(module), "_sw_format"):
            module.__dict__.setdefault("_sw_tree", state.tree)
    return state.census()


def apply_policy(model: nn.Module, policy: "Policy | str") -> tuple["Policy", Plan]:
    """Resolve `policy` (a Policy, or a name or file to load) against `model` and convert it.

    Returns the loaded Policy and its Plan; raises PolicyError when the policy does not fit.
    """
    from ...schemas import Policy
    from ..policy.diagnostics import PolicyError
    from ..policy.load import load_policy
    from ..plan.resolve import resolve

    policy = policy if isinstance(policy, Policy) else load_policy(policy)
    plan = resolve(policy, model)
    if not plan.ok:
        raise PolicyError(plan.diagnostics)
    apply(plan, model)
    return policy, plan


def check(plan: Plan, model: nn.Module) -> list[tuple[ModulePlan, tuple[nn.Module, type]]]:
    """Everything `apply` will change, checked without changing anything (raises ConversionError)."""
    if not plan.ok:
        raise ConversionError("the plan has errors; fix the policy first:\n" + "\n".join(
            f"{d.severity}[{d.code}]: {d.message}" for d in plan.diagnostics if d.is_error
        ))
    return [(entry, _target(entry, model)) for entry in plan.modules if entry.stream or entry.relocate]


def revert(model: nn.Module) -> None:
    """Restore the original classes and attributes of a converted tree (tensors stay where they are)."""
    state = model.__dict__.get(STATE_ATTRIBUTE)
    if state is None:
        raise ConversionError("this model was not converted by streamwise.apply")
    if any(hasattr(type(m), "_sw_format") for m in model.modules()):
        raise ConversionError("the tree holds quantized residents, whose float weights are gone; reload the model instead")
    del model.__dict__[STATE_ATTRIBUTE]
    for record in reversed(state.records):
        _restore(record)


def _quantized(plan: Plan, model: nn.Module) -> list[tuple[ModulePlan, nn.Module, dict]]:
    """The quantized tensors for the plan's int8-family layers, computed without changing the tree.

    GGUF residents come from GGUF files (`streamwise.load`); a `gguf` rule on float weights keeps them.
    """
    from ..quant.formats import FORMATS

    quantized = []
    for entry in plan.modules:
        fmt = FORMATS.get(entry.quant or "")
        module = model.get_submodule(entry.path) if fmt is not None else None
        if module is None or not fmt.quantizes_on_load or hasattr(type(module), "_sw_format"):
            continue
        quantized.append((entry, module, fmt.quantize(module.weight.detach(), entry.group_size)))
    return quantized


def _target(entry: ModulePlan, model: nn.Module) -> tuple[nn.Module, type]:
    """The module a plan entry names and the class it must end up with; checks everything first."""
    try:
        module = model.get_submodule(entry.path)
    except AttributeError:
        raise ConversionError(f"the plan names `{entry.path}`, which this model does not have") from None
    if hasattr(type(module), "_sw_format"):
        return module, type(module)  # a quantized resident already streams
    original = getattr(type(module), "_sw_original_class", type(module))
    seen = ModuleRef.of(entry.path, module).classes[0][1]
    if seen != entry.class_name:
        raise ConversionError(f"`{entry.path}` is a {seen}, but the plan was resolved for a {entry.class_name}")
    if entry.stream and "forward" in module.__dict__:
        raise ConversionError(f"`{entry.path}` has a forward of its own (a hook installs these), which would bypass "
                              "streaming; remove the hook or exclude the module from the policy")
    if entry.stream:
        missing = COMPUTE_KINDS[entry.stream].missing(module)
        if missing:
            raise ConversionError(
                f"`{entry.path}` ({original.__name__}) cannot compute as `{entry.stream}`: it has no {', '.join(missing)}"
            )
        target = streaming_class(original, entry.stream)
    else:
        target = relocating_class(original)
    if type(module) not in (original, target):
        raise ConversionError(f"`{entry.path}` was already converted differently ({type(module).__name__})")
    return module, target


def _convert(module: nn.Module, cls: type, entry: ModulePlan, tree: StreamTree) -> _Record:
    attributes: dict[str, object] = {"_sw_tree": tree}
    if entry.stream:
        attributes.update(comfy_cast_weights=False, weight_function=[], bias_function=[])
        if not hasattr(module, "bias"):
            attributes["bias"] = None  # ComfyUI's cast_bias_weight reads `bias` on every op
    else:
        attributes["_sw_relocated"] = entry.relocate
    record = swap_class(module, cls, attributes, "stream" if entry.stream else "relocate")
    if not entry.stream:
        tree.relocating.append(module)
    return record


def swap_class(module: nn.Module, cls: type, attributes: dict[str, object], role: str) -> _Record:
    """Give `module` the class `cls` and plain `attributes`, returning how to undo it."""
    record = _Record(module, type(module), {name: module.__dict__.get(name, _ABSENT) for name in attributes}, role)
    module.__class__ = cls
    module.__dict__.update(attributes)
    return record


def _restore(record: _Record) -> None:
    module = record.module
    tree = module.__dict__.get("_sw_tree")
    if tree is not None and any(m is module for m in tree.relocating):
        tree.relocating = [m for m in tree.relocating if m is not module]
    module.__class__ = record.original_class
    for name, previous in record.replaced.items():
        if previous is _ABSENT:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = previous
