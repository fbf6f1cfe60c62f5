"""`resolve(policy, model)`: decide, for every module of a live tree, what the policy does to it.

Pure and deterministic: it reads `named_modules()` and the tensors' sizes (meta tensors work),
changes nothing, and returns a `Plan` with the deciding rule of every role, a coverage census in
bytes, and diagnostics: rules that match nothing, rules that tie and disagree, streamed
"leaves" that hold parameter-holding children, modules that would both stream and relocate, and
tensors that no rule handles (those would be stranded under partial offload).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from torch import nn

from ...schemas import Policy
from ..policy.diagnostics import Diagnostic, Note, PolicyError, did_you_mean
from ..policy.load import as_policy
from .plan import Coverage, ModulePlan, Plan, TensorRef
from .precedence import RuleConflict, decide
from .selectors import CompiledSelector, ModuleRef, within

_SECTIONS = ("stream", "relocate", "quant")
_LINEAR_ONLY = ("int8", "convrot_int8", "convrot_int4")
_FETCHED = ("weight", "bias")  # what a streamed leaf's fetch brings; any other tensor of it stays behind
_MAX_LISTED = 8


def plan_for(
    policy: Policy | str | os.PathLike[str], model: nn.Module, *, dirs: Iterable[str | os.PathLike] = ()
) -> tuple[Policy, Plan]:
    """The policy (loaded when given a name or path) and its plan for `model`; PolicyError unless the plan is ok."""
    policy = as_policy(policy, dirs=dirs)
    plan = resolve(policy, model)
    if not plan.ok:
        raise PolicyError(plan.diagnostics)
    return policy, plan


def resolve(policy: Policy, model: nn.Module) -> Plan:
    sections = {
        name: (
            [(rule, CompiledSelector(rule.select)) for rule in getattr(policy, name).rule],
            CompiledSelector(getattr(policy, name).exclude) if getattr(policy, name).exclude else None,
        )
        for name in _SECTIONS
    }
    blocks = CompiledSelector(policy.compile.blocks) if policy.compile.blocks else None
    matches = {f"{name}.{rule.id}": 0 for name in _SECTIONS for rule in getattr(policy, name).rule}
    if blocks is not None:
        matches["compile.blocks"] = 0
    problems: list[Diagnostic] = []
    plans: list[ModulePlan] = []
    census = _Census()
    units: list[str] = []

    for path, module in model.named_modules():
        ref = ModuleRef.of(path, module)
        decided = {}
        for name, (rules, exclude) in sections.items():
            try:
                decision = decide(rules, ref, exclude)
            except RuleConflict as conflict:
                problems.append(_conflict(name, conflict))
                decision = None
            decided[name] = decision.rule if decision else None
            if decision:
                matches[f"{name}.{decision.rule.id}"] += 1
        stream, relocate, quant = decided["stream"], decided["relocate"], decided["quant"]
        if stream is not None and _holds_parameters_below(module):
            problems.append(_rule_problem(
                "stream-container", stream,
                f"stream rule `{stream.id}` selects `{path or '<root>'}` ({ref.classes[0][0]}), whose children hold "
                "parameters; stream leaves, and relocate the direct tensors of containers",
            ))
            stream = None
        if stream is not None and relocate is not None:
            problems.append(_rule_problem(
                "rule-conflict", relocate,
                f"`{path or '<root>'}` would both stream (rule `{stream.id}`) and relocate (rule `{relocate.id}`)",
                notes=(Note(f"`{stream.id}` is here", _rule_location(stream)),),
            ))
            relocate = None
        weight = module._parameters.get("weight")
        if quant is not None and (weight is None or weight.numel() < quant.min_weights):
            quant = None  # nothing to quantize, or too small to be worth it
        if quant is not None and quant.format in _LINEAR_ONLY and not isinstance(module, nn.Linear):
            problems.append(_rule_problem(
                "quant-unsupported", quant,
                f"quant rule `{quant.id}`: `{quant.format}` applies to Linear layers, and `{path}` is a {ref.classes[0][0]}",
                help="narrow the selector, or exclude these layers in [quant]",
            ))
            quant = None
        if quant is not None and quant.effective_group_size and isinstance(module, nn.Linear):
            if module.in_features % quant.effective_group_size:
                problems.append(_rule_problem(
                    "invalid-group-size", quant,
                    f"quant rule `{quant.id}`: group size {quant.effective_group_size} does not divide "
                    f"in_features {module.in_features} of `{path}`",
                    help="pick a power of 4 that divides every selected layer's in_features, or exclude the layer",
                ))
                quant = None
        unit = blocks is not None and blocks.matches(ref) and not any(within(path, u) for u in units)
        if unit:
            units.append(path)
            matches["compile.blocks"] += 1
        relocated = tuple(census.visit(path, module, stream is not None, relocate is not None))
        if stream or relocate or quant or unit:
            plans.append(ModulePlan(
                path=path,
                class_name=ref.classes[0][1],
                stream=stream.kind if stream else None,
                stream_rule=stream.id if stream else None,
                relocate=relocated if relocate else (),
                relocate_rule=relocate.id if relocate else None,
                quant=quant.format if quant else None,
                quant_rule=quant.id if quant else None,
                group_size=quant.effective_group_size if quant else None,
                gguf_type=quant.effective_gguf_type if quant else None,
                compile_unit=unit,
            ))

    problems += _unmatched(policy, sections, matches, model)
    coverage = census.coverage()
    if coverage.stranded:
        problems.append(_stranded(coverage))
    return Plan(
        policy=policy.name,
        root_class=ModuleRef.of("", model).classes[0][1],
        compile=policy.compile,
        modules=tuple(plans),
        coverage=coverage,
        rule_matches=matches,
        diagnostics=tuple(problems),
    )


class _Census:
    """Bytes per role, counting every tensor once (tied parameters are one tensor)."""

    def __init__(self) -> None:
        self.bytes = {"streamed": 0, "relocated": 0, "stranded": 0}
        self.stranded: list[TensorRef] = []
        self.names: dict[int, list[str]] = {}

    def visit(self, path: str, module: nn.Module, streamed: bool, relocated: bool) -> Iterable[str]:
        tensors = [(n, t, "parameter") for n, t in module.named_parameters(recurse=False)]
        tensors += [(n, t, "buffer") for n, t in module.named_buffers(recurse=False)]
        for name, tensor, kind in tensors:
            full = f"{path}.{name}" if path else name
            aliases = self.names.setdefault(id(tensor), [])
            aliases.append(full)
            if relocated:
                yield name
            if len(aliases) > 1:
                continue
            size = tensor.numel() * tensor.element_size()
            fetched = streamed and kind == "parameter" and name in _FETCHED
            role = "relocated" if relocated else "streamed" if fetched else "stranded"
            self.bytes[role] += size
            if role == "stranded":
                self.stranded.append(TensorRef(full, kind, size))

    def coverage(self) -> Coverage:
        tied = tuple(tuple(names) for names in self.names.values() if len(names) > 1)
        return Coverage(dict(self.bytes), tuple(self.stranded), tied)


def _holds_parameters_below(module: nn.Module) -> bool:
    return any(True for child in module.children() for _ in child.parameters())


def _rule_location(rule: Any):
    origin = getattr(rule, "_origin", None)
    if origin is None:
        return None
    source, path = origin
    return source.locate(path + ("select",))


def _rule_problem(code: str, rule: Any, message: str, **extra) -> Diagnostic:
    return Diagnostic(code, message, _rule_location(rule), **extra)


def _conflict(section: str, conflict: RuleConflict) -> Diagnostic:
    first, second = conflict.first, conflict.second
    return _rule_problem(
        "rule-conflict", second,
        f"rules `{first.id}` and `{second.id}` in [{section}] select `{conflict.module.path or '<root>'}` equally "
        f"specifically but disagree ({first.decision} vs {second.decision})",
        notes=(Note(f"`{first.id}` is here", _rule_location(first)),),
        help="make one of the two rules more specific (an exact path beats a glob, a glob beats a class)",
    )


def _unmatched(policy: Policy, sections: dict, matches: dict[str, int], model: nn.Module) -> list[Diagnostic]:
    """Rules whose selector hits no module: not those outranked everywhere, nor those whose modules are excluded."""
    classes = sorted({ModuleRef.of("", m).classes[0][0] for m in model.modules()})
    problems = []
    for section in _SECTIONS:
        for rule, selector in sections[section][0]:
            if rule.optional or matches[f"{section}.{rule.id}"]:
                continue
            if any(selector.matches(ModuleRef.of(path, module)) for path, module in model.named_modules()):
                continue  # it selects modules, but decides none
            guess = next(filter(None, (did_you_mean(name.rsplit(".", 1)[-1], classes) for name in rule.select.class_)), None)
            problems.append(_rule_problem(
                "unmatched-rule", rule,
                f"rule `{rule.id}` in [{section}] matches no module of `{ModuleRef.of('', model).classes[0][0]}`",
                suggestion=guess,
                help="fix the selector, or mark the rule `optional = true` if some models of the family lack these modules",
            ))
    return problems


def _stranded(coverage: Coverage) -> Diagnostic:
    listed = ", ".join(t.name for t in coverage.stranded[:_MAX_LISTED])
    more = len(coverage.stranded) - _MAX_LISTED
    return Diagnostic(
        "stranded-tensors",
        f"{len(coverage.stranded)} tensors ({coverage.bytes['stranded']} bytes) are handled by no rule; "
        "a partial load would leave them on the offload device",
        severity="warning",
        help=f"stranded: {listed}" + (f", and {more} more" if more > 0 else ""),
    )
