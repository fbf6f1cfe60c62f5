"""`resolve(policy, model)`: decide, for every module of a live tree, what the policy does to it.

Pure and deterministic: it reads the module tree and the tensors' sizes (meta tensors work),
changes nothing, and returns a `Plan` with the deciding rule of every role, a coverage census in
bytes, and diagnostics: rules that match nothing, rules that tie and disagree, streamed
"leaves" that hold parameter-holding children, modules that would both stream and relocate, and
tensors that no rule handles (those would be stranded under partial offload).

It is built to cost little more than a walk over the tree: the policy is compiled once, what
depends on a module's class alone is decided once per class, and each module's tensors are read in
one pass (`benchmarks/bench_resolve.py`).
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor, nn

from ...schemas import Policy
from ...schemas.vocabulary import AUTO_KIND, LINEAR_ONLY_QUANT_FORMATS
from ..engine import file_tier, protocol
from ..engine.class_facts import class_fact
from ..engine.file_tier import FileTensor
from ..engine.kinds import COMPUTE_KINDS, FETCHED, GENERIC, Fit, fit
from ..engine.streamed import holds_parameters_below
from ..policy.diagnostics import Diagnostic, Note, did_you_mean
from .plan import Coverage, ModulePlan, Plan, TensorRef
from .precedence import RuleConflict, Section
from .selectors import (
    CLASS,
    EXACT_PATH,
    HOLDS,
    QUALIFIED_CLASS,
    REPEATED,
    CompiledSelector,
    ModuleRef,
    class_names,
    declared_blocks,
    found_blocks,
    holds,
    joined,
    walk_modules,
    within,
)

_MAX_LISTED = 8
# Selections that name one class or module exactly: a deliberate claim that an unproven kind computes it (probed).
_NAMED = {(CLASS, QUALIFIED_CLASS), (EXACT_PATH, 0)}


def resolve(policy: Policy, model: nn.Module) -> Plan:
    """Every module's roles with their deciding rules, the coverage census and the diagnostics."""
    return resolve_with_modules(policy, model)[0]


def resolve_with_modules(policy: Policy, model: nn.Module) -> tuple[Plan, list[nn.Module]]:
    """`resolve`, and the module each plan entry names, in order: an apply that follows needs no walk."""
    matcher = _matcher(policy)
    walk = walk_modules(model)
    problems: list[Diagnostic] = []
    ties: dict[tuple[str, str, str], list[RuleConflict]] = {}  # (section, rule, rival): one diagnostic each
    plans: list[ModulePlan] = []
    modules: list[nn.Module] = []  # the module of each plan entry
    coverage = _CoverageCounter()
    count, decide, by_class, blocks = coverage.count, matcher.decide, matcher.by_class, matcher.blocks
    blocks_by_module = blocks is not None and blocks.by_module
    seen: dict[_Decided, int] = {}  # how many modules each decision decided: the rule match counts
    per_module: list[tuple[Diagnostic, str]] = []
    unit_path: str | None = None  # the last compile unit: a pre-order walk meets what lies in it next
    units = 0
    claim: str | None = None  # the last generic container: it fetches the parameters of what lies in it
    blocks_below: _BlocksBelow | None = None  # made when a generic container is met (few trees have one)

    key = matcher.key
    declared = declared_blocks(walk) if matcher.no_split else frozenset()
    unit_by_path = blocks_by_module or bool(declared)  # whether being a compile unit can depend on more than class
    for path, module in walk:
        decided = by_class.get(key(module)) or decide(path, module, ties)
        if decided.inert and not unit_by_path and not (module._parameters or module._buffers):
            continue  # nothing to decide, count or plan (no rule decides it): most containers
        seen[decided] = seen.get(decided, 0) + 1
        roles, template, streams = decided.roles, decided.template, decided.streams
        kind = decided.fit
        for check in decided.checks if module._modules else decided.leaf_checks:
            failed = check(path, module, roles, kind)
            if failed is not None:
                stream, (roles, problem) = roles.stream, failed
                if roles.stream is not stream:  # dropped, or `auto` fell back to generic
                    kind = fit(roles.stream.kind, type(module)) if roles.stream is not None else None
                template, streams = _template(template[0][0], roles, kind), _streams(roles, kind)
                if problem is not None:
                    per_module.append(problem)  # one diagnostic per distinct problem, listing the modules
        if claim is not None and within(path, claim):  # a generic container above fetches its parameters
            roles, streams = roles._replace(stream=None, relocate=None), ALL
            kind, template = None, _template(template[0][0], roles, None)
        elif roles.stream is not None and kind.kind == GENERIC and holds_parameters_below(module):
            auto = decided.roles.stream is not None and decided.roles.stream.kind == AUTO_KIND
            if auto and (blocks_below := blocks_below or _BlocksBelow(walk, matcher)).hold(path):
                # one streamed unit would hold the model's blocks (the whole model, for the root): its own tensors
                # follow the compute device instead, and what it holds is planned on its own
                roles, streams, kind = roles._replace(stream=None, relocate=decided.roles.stream), None, None
                template = _template(template[0][0], roles, None, _ABOVE_BLOCKS)
            else:
                claim = path
        relocated = count(path, module, roles, streams) if module._parameters or module._buffers else ()
        unit = bool(decided.block or blocks_by_module and blocks.module_specificity(path, module) is not None
                    or declared and class_names(type(module))[0].short in declared) and not (
            unit_path is not None and within(path, unit_path))
        if unit:
            unit_path = path
            units += 1
        if unit or relocated or (decided.any if roles is decided.roles else roles.any):
            plans.append(tuple.__new__(ModulePlan, (path, *template[0], relocated, *template[1], unit, template[2])))
            modules.append(module)

    matches = dict.fromkeys(matcher.rule_keys, 0)
    for decided, decided_modules in seen.items():
        for rule_key in decided.keys:
            matches[rule_key] += decided_modules
    if blocks is not None:
        matches["compile.blocks"] = units
    problems += [_conflict(section, conflicts) for (section, *_), conflicts in ties.items()]
    problems += _grouped(per_module)
    problems += _unmatched(matcher, matches, walk)
    problems += _unused(matcher, matches, walk)
    counted = coverage.coverage(walk)
    if counted.stranded:
        problems.append(_stranded(counted))
    plan = Plan(
        policy=policy.name,
        root_class=ModuleRef.of("", model).qualname,
        compile=policy.compile,
        modules=tuple(plans),
        coverage=counted,
        rule_matches=matches,
        diagnostics=tuple(problems),
    )
    return plan, modules


class _Roles(NamedTuple):
    """The rule that decides each role of one module (None: the module has not that role)."""

    stream: Any = None
    relocate: Any = None
    quant: Any = None

    @property
    def any(self) -> bool:
        return self.stream is not None or self.relocate is not None or self.quant is not None

    @property
    def decided(self) -> set[str]:
        """The names of the roles some rule decides."""
        return {role for role, rule in zip(self._fields, self, strict=True) if rule is not None}


# A check sees one module, its roles and how its stream kind fits its class; it returns None when they stand, else
# the roles left and the problem: (a diagnostic saying nothing of the path, the path), listed with the modules
# where the same problem was found, or None (a silent fallback).
Check = Callable[[str, nn.Module, _Roles, "Fit | None"], "tuple[_Roles, Any] | None"]
# A plan entry without its per-module fields: (class_name, stream, stream_rule), what follows `relocate`, and why
# the stream kind was chosen.
Template = tuple[tuple[str, str | None, str | None], tuple, str | None]
#: The order `ModulePlan`'s fields are built in from a template, positionally (several times faster than by keyword
#: for the thousands of entries of a large model): path, the template's head, relocated tensors, its tail, the unit
#: flag, the reason. `tests/plan/test_resolve.py` holds it to `ModulePlan._fields`, so a field added or moved fails
#: there.
ENTRY_LAYOUT = ("path", "class_name", "stream", "stream_rule", "relocate", "relocate_rule", "quant", "quant_rule",
                "group_size", "gguf_type", "compile_unit", "kind_reason")
# What a streamed module's fetch brings: the names of its parameters that stream, ALL of them, or None (nothing).
ALL = ("*",)


class _Decided:
    """What the rules make of one module (of every module of its class, when no rule names paths).

    Compared by identity: resolve counts the modules each one decides.
    """

    __slots__ = ("roles", "any", "keys", "fit", "checks", "leaf_checks", "template", "streams", "block", "inert")

    def __init__(self, roles: _Roles, keys: tuple[str, ...], cls: type, block: bool, named: bool) -> None:
        self.roles = roles
        self.keys = keys  # the `rule_matches` keys of the deciding rules
        # `auto` chosen per class; a specific kind holds an unproven class only where the rule named it exactly
        self.fit = fit(roles.stream.kind, cls, named=named) if roles.stream is not None else None
        decided = roles.decided
        self.checks = tuple(check for needs, check in _CHECKS  # those that apply and may fail for this class
                            if needs <= decided and not (check in _PASSES_FOR_CLASS
                                                         and _PASSES_FOR_CLASS[check](roles, cls)))
        # for a module without children, in which no parameters can hide
        self.leaf_checks = tuple(check for check in self.checks if check is not _stream_leaf)
        self.template = _template(class_names(cls)[0].qualified, roles, self.fit)
        # what a fetch brings; a host's own streaming layer (ComfyUI's `comfy.ops`) fetches its weight and bias, a
        # quantized resident (one a load or an earlier conversion made) everything it stores, whatever the rules
        if protocol.speaks_natively(cls):
            self.streams = FETCHED
        else:
            self.streams = ALL if getattr(cls, protocol.HANDLER, None) is not None else _streams(roles, self.fit)
        self.block = block  # whether the compile blocks select the class
        self.any = roles.any  # read per module: a slot, not the property
        self.inert = not roles.any and not block  # no role, no compile unit: a module holding no tensors is skipped


class _Matcher:
    """A policy's sections and compile blocks compiled once, with what they decide per class.

    Made once per Policy object (`_matcher`): a second resolve of the same policy decides no class again.
    When no rule or exclude names paths, what decides one module decides every module of its class (and of what
    it holds, when a rule selects by `holds`).
    """

    def __init__(self, policy: Policy) -> None:
        self.sections: dict[str, Section] = {}
        for name in Policy.RULE_SECTIONS:  # in the order the sections are decided
            section = getattr(policy, name)
            exclude = CompiledSelector(section.exclude) if section.exclude else None
            self.sections[name] = Section([(rule, CompiledSelector(rule.select)) for rule in section.rule], exclude)
        self.rule_keys = [f"{name}.{rule.id}" for name, section in self.sections.items() for rule, _ in section.rules]
        self.blocks = CompiledSelector(policy.compile.blocks) if policy.compile.blocks else None
        self.no_split = policy.compile.blocks is not None and policy.compile.blocks.no_split
        self._per_class = not any(section.path_dependent for section in self.sections.values())
        by_holds = any(section.holds_dependent for section in self.sections.values())
        self.key: Callable[[nn.Module], object] = (lambda module: (type(module), holds(module))) if by_holds else type
        """What a decision depends on besides the path: the class, and what the module holds if a rule asks."""
        self.by_class: dict[object, _Decided] = {}  # by `key`; stays empty when decisions depend on paths

    def decide(self, path: str, module: nn.Module, ties: dict[tuple, list[RuleConflict]]) -> _Decided:
        """The rules that decide `module` and the checks they need; ties that disagree go to `ties`, by rule pair."""
        decisions, tied = {}, False
        for name, section in self.sections.items():
            try:
                decision = section.decide(path, module)
            except RuleConflict as conflict:
                ties.setdefault((name, conflict.first.id, conflict.second.id), []).append(conflict)
                decision, tied = None, True
            if decision is not None:
                decisions[name] = decision
        if "stream" in decisions and "relocate" in decisions:  # a catch-all yields to the other section's rule
            caught = [name for name in ("stream", "relocate") if decisions[name].specificity[0] == HOLDS]
            if len(caught) == 1:
                del decisions[caught[0]]
        if protocol.speaks_natively(type(module)):
            decisions.pop("stream", None)  # it streams already: a host's own layer (ComfyUI's `comfy.ops`)
        rules = {name: decision.rule for name, decision in decisions.items()}
        keys = [f"{name}.{decision.rule.id}" for name, decision in decisions.items()]
        blocks = self.blocks is not None and self.blocks.of_class[type(module)] is not None
        named = "stream" in decisions and decisions["stream"].specificity in _NAMED
        decided = _Decided(_Roles(**rules), tuple(keys), type(module), blocks, named)
        if self._per_class and not tied:  # a tie is reported per module, so it is never cached
            self.by_class[self.key(module)] = decided
        return decided


def _matcher(policy: Policy) -> _Matcher:
    """The policy's matcher, compiled on first use and kept while the Policy object lives."""
    held = _MATCHERS.get(id(policy))
    if held is not None and held[0]() is policy:
        return held[1]
    key = id(policy)
    matcher = _MATCHERS[key] = (weakref.ref(policy, lambda _: _MATCHERS.pop(key, None)), _Matcher(policy))
    return matcher[1]


_MATCHERS: dict[int, tuple[weakref.ref, _Matcher]] = {}


def _stream_leaf(path: str, module: nn.Module, roles: _Roles, kind: Fit | None):
    """A streamed module fetches only its own tensors: with a specific kind, which computes the whole module from
    them, children holding parameters would be left out (a `generic` container runs their forwards)."""
    rule = roles.stream
    if rule is None or kind.kind == GENERIC and kind.note is None or not holds_parameters_below(module):
        return None  # a look-alike's note stands for a specific kind, which a container refuses
    if rule.kind == AUTO_KIND:  # not proven for a container: its own forward is
        return roles._replace(stream=rule.model_copy(update={"kind": GENERIC})), None
    return roles._replace(stream=None), (_rule_problem(
        "stream-container", rule,
        f"stream rule `{rule.id}` (kind `{rule.kind}`) selects {ModuleRef.of(path, module).name}, whose children "
        "hold parameters; a specific kind computes leaves",
        help='stream the container with `kind = "generic"` (it claims its children), or select its leaves',
    ), path)


def _kind_fits(path: str, module: nn.Module, roles: _Roles, kind: Fit | None):
    """A specific kind computes what the class it was made for computes: refused where the class provably computes
    otherwise, or lacks an attribute the kind reads; a look-alike of the class computes with its own forward, with
    a note; a class the rule named exactly is probed on real weights (in `apply`)."""
    rule = roles.stream
    if rule is None or kind.proven and kind.note is None and kind.needs <= module._parameters.keys():
        return None  # the common case: a proven kind, with what it reads
    asked = rule.kind if kind.note is not None else kind.kind  # the kind the rule stands for
    missing = COMPUTE_KINDS[asked].missing(module) if asked != GENERIC else ()
    derived = [name for name in FETCHED if isinstance(module.__dict__.get(name), Tensor)] if asked != GENERIC else ()
    if derived and rule.kind == AUTO_KIND:  # computed from other parameters: its own forward computes it
        return roles._replace(stream=rule.model_copy(update={"kind": GENERIC})), None
    if derived:
        message = (f"stream rule `{rule.id}`: `{ModuleRef.of(path, module).name}` computes its `{derived[0]}` from "
                   f"other parameters (`weight_norm`, or a hook), which kind `{asked}` cannot fetch")
    elif kind.refused is not None:
        message = f"stream rule `{rule.id}`: {kind.refused}"
    elif missing:
        message = (f"stream rule `{rule.id}`: `{ModuleRef.of(path, module).name}` has no {', '.join(missing)}, "
                   f"which kind `{asked}` reads")
    elif kind.note is not None:  # a look-alike: it computes with its own forward, and the plan says so
        return roles, (Diagnostic(
            "unproven-kind", f"stream rule `{rule.id}` (kind `{rule.kind}`): {kind.note}", _rule_location(rule),
            severity="warning",
            help="select the class by its qualified name to hold it to this kind (a probe checks it on real "
                 'weights), or use `kind = "auto"`',
        ), path)
    elif (not kind.proven and (weight := module._parameters.get("weight")) is not None
          and not file_tier.in_memory(weight)):
        # it stands, but say so where no probe can run yet (`policy-validate --model`, on meta)
        return roles, (Diagnostic(
            "unproven-kind", f"stream rule `{rule.id}` computes `{ModuleRef.of(path, module).name}` as "
            f"`{kind.kind}`, which nothing about the class proves; apply probes it on real weights",
            _rule_location(rule), severity="warning",
            help='`kind = "auto"` picks a specific kind only where it is proven, else `generic`',
        ), path)
    else:
        return None
    return roles._replace(stream=None), (_rule_problem(
        "kind-mismatch", rule, message,
        help='use `kind = "auto"` (a specific kind only where it is proven) or `kind = "generic"` (any module)',
    ), path)


def _stream_takes_input(path: str, module: nn.Module, roles: _Roles, kind: Fit | None):
    """A generic module fetches to the device of its input: one whose forward takes none relocates instead (its
    parameters follow the compute device), decided here rather than failing at its first forward."""
    if roles.stream is None or kind.kind != GENERIC:
        return None
    return roles._replace(stream=None, relocate=roles.stream), None


@class_fact
def _takes_input(cls: type) -> bool:
    """Whether the class's forward takes any argument (an input a generic fetch can follow); reading a signature
    costs more than the rest of a class's decision."""
    try:
        return len(inspect.signature(protocol.original_class(cls).forward).parameters) > 1
    except (TypeError, ValueError):  # no signature to read: assume it does
        return True


def _stream_or_relocate(path: str, module: nn.Module, roles: _Roles, kind: Fit | None):
    """A streamed leaf's tensors come through the fetcher; they cannot also follow the compute device."""
    stream, relocate = roles.stream, roles.relocate
    if stream is None or relocate is None:
        return None
    return roles._replace(relocate=None), (_rule_problem(
        "rule-conflict", relocate,
        f"{ModuleRef.of(path, module).name} would both stream (rule `{stream.id}`) and relocate (rule "
        f"`{relocate.id}`)",
        notes=(Note(f"`{stream.id}` is here", _rule_location(stream)),),
    ), path)


def _quant_worth_it(path: str, module: nn.Module, roles: _Roles, kind: Fit | None):
    """Nothing to quantize, or too few weights to be worth it: the layer stays float, silently."""
    rule = roles.quant
    if rule is None:
        return None
    weight = module._parameters.get("weight")
    if weight is not None and weight.numel() >= rule.min_weights:
        return None
    return roles._replace(quant=None), None


def _quant_linear_only(path: str, module: nn.Module, roles: _Roles, kind: Fit | None):
    rule = roles.quant
    if rule is None or rule.format not in LINEAR_ONLY_QUANT_FORMATS or isinstance(module, nn.Linear):
        return None
    return roles._replace(quant=None), (_rule_problem(
        "quant-unsupported", rule,
        f"quant rule `{rule.id}`: `{rule.format}` applies to Linear layers, not to {ModuleRef.of(path, module).name}",
        help="narrow the selector, or exclude these layers in [quant]",
    ), path)


def _quant_group_size(path: str, module: nn.Module, roles: _Roles, kind: Fit | None):
    rule = roles.quant
    if rule is None or not rule.effective_group_size or not isinstance(module, nn.Linear):
        return None
    if not module.in_features % rule.effective_group_size:
        return None
    return roles._replace(quant=None), (_rule_problem(
        "invalid-group-size", rule,
        f"quant rule `{rule.id}`: group size {rule.effective_group_size} does not divide in_features "
        f"{module.in_features}",
        help="pick a power of 4 that divides every selected layer's in_features, or exclude the layer",
    ), path)


# In this order, each with the roles it needs: a check sees the roles the checks before it left.
_CHECKS: tuple[tuple[set[str], Check], ...] = (
    ({"stream"}, _stream_leaf),
    ({"stream"}, _kind_fits),
    ({"stream", "relocate"}, _stream_or_relocate),
    ({"stream"}, _stream_takes_input),
    ({"quant"}, _quant_worth_it),
    ({"quant"}, _quant_linear_only),
    ({"quant"}, _quant_group_size),
)


# Checks that a class alone can pass, for every module of it: not run per module then.
_PASSES_FOR_CLASS: dict[Check, Callable[[_Roles, type], bool]] = {
    _stream_takes_input: lambda roles, cls: _takes_input(cls),
    _quant_linear_only: lambda roles, cls: (roles.quant.format not in LINEAR_ONLY_QUANT_FORMATS
                                            or issubclass(cls, nn.Linear)),
    _quant_group_size: lambda roles, cls: not roles.quant.effective_group_size or not issubclass(cls, nn.Linear),
}


def _template(class_name: str, roles: _Roles, kind: Fit | None, reason: str | None = None) -> Template:
    """The plan entry `roles` make of a module of `class_name`, less its path, relocated tensors and unit flag
    (`reason`: why a module a stream rule selected relocates instead)."""
    stream, relocate, quant = roles
    head = (class_name, kind.kind if stream else None, stream.id if stream else None)
    tail = (relocate.id if relocate else None, quant.format if quant else None, quant.id if quant else None,
            quant.effective_group_size if quant else None, quant.effective_gguf_type if quant else None)
    return head, tail, kind.reason if stream else reason


_ABOVE_BLOCKS = "holds the model's blocks: its own tensors follow the compute device, not one streamed unit"


class _BlocksBelow:
    """Where a tree's blocks are: a generic container above one would make a single streamed unit of them all.

    The blocks are the modules the policy's compile blocks select and those of the classes the tree declares as its
    repeated blocks (transformers' `_no_split_modules`, diffusers' `_repeated_blocks`). Where none of these names a
    module of the tree (timm's ViT, open_clip's CLIP), they are found: the children of its largest `ModuleList` or
    `Sequential` by parameter bytes whose children, at least 2, share one class (`found_blocks`). So a root holding
    direct parameters (`cls_token`, `pos_embed`) above blocks nobody declared relocates them instead of streaming
    the whole model as one unit.
    """

    def __init__(self, walk: list[tuple[str, nn.Module]], matcher: _Matcher) -> None:
        declared, selector = declared_blocks(walk, REPEATED), matcher.blocks
        self.paths = [path for path, module in walk if class_names(type(module))[0].short in declared
                      or selector is not None and selector.matches_module(path, module)] or found_blocks(walk)

    def hold(self, outer: str) -> bool:
        """Whether a block lies strictly inside the module at `outer`."""
        return any(path != outer and within(path, outer) for path in self.paths)


def _streams(roles: _Roles, kind: Fit | None) -> tuple[str, ...] | None:
    """The direct parameters a module's stream role fetches (`ALL`: every one, the generic kind), or None."""
    if roles.stream is None or roles.relocate is not None:
        return None
    return ALL if kind.kind == GENERIC else FETCHED


class _CoverageCounter:
    """Bytes per role, counting every tensor once (tied parameters are one tensor).

    A tensor's first place is kept as the module's path alone (its name is looked up for the rare tied tensor), the
    others as (module path, tensor name); they are joined only for what is reported.
    """

    def __init__(self) -> None:
        self.streamed = self.relocated = self.stranded_bytes = self.file_bytes = self.file_modules = 0
        self.stranded: list[TensorRef] = []
        self._first: dict[int, str] = {}  # by tensor id: the path of the module it was first seen in
        self._aliases: dict[int, list[tuple[str, str]]] = {}  # by tensor id: where else it was seen

    def count(self, path: str, module: nn.Module, roles: _Roles, streams: tuple[str, ...] | None) -> tuple[str, ...]:
        """Count the module's direct tensors in one pass; returns the names of those it relocates: all of them for
        a relocating module, the buffers of a generic streamed one (its kind fetches parameters only)."""
        first = self._first
        relocated = roles.relocate is not None
        every = streams is ALL
        streamed = moved = stranded = in_file = 0
        parameters, buffers = module._parameters, module._buffers
        # per slot: what the fetch brings (buffers never come through it), whether all of it follows the device
        slots = ((parameters, "parameter", streams, relocated), (buffers, "buffer", None, relocated or every))
        for tensors, kind, fetched, follows in slots if buffers else slots[:1]:
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                key = id(tensor)
                if key in first:
                    self._seen_again(key, path, name, tensors, tensor)
                    continue
                first[key] = path
                if isinstance(tensor, FileTensor):
                    in_file += tensor.source.range.nbytes
                if follows:
                    moved += tensor.nbytes
                elif fetched is ALL or fetched is not None and name in fetched:
                    streamed += tensor.nbytes
                else:
                    stranded += tensor.nbytes
                    self.stranded.append(TensorRef(joined(path, name), kind, tensor.nbytes, type(module).__name__))
        self.streamed += streamed
        self.relocated += moved
        self.stranded_bytes += stranded
        if in_file:
            self.file_bytes += in_file
            self.file_modules += 1
        if not (relocated or every):
            return ()
        sources = (parameters, buffers) if relocated else (buffers,)
        return tuple(name for tensors in sources for name, tensor in tensors.items()
                     if tensor is not None and not _named_earlier(tensors, name, tensor))

    def _seen_again(self, key: int, path: str, name: str, tensors: dict, tensor: object) -> None:
        """A tensor met before: tied elsewhere, unless this module holds it under an earlier name too."""
        if not _named_earlier(tensors, name, tensor):  # one tensor under two names of one module: torch yields it once
            self._aliases.setdefault(key, []).append((path, name))

    def coverage(self, walk: list[tuple[str, nn.Module]]) -> Coverage:
        """The census; tied groups in the order their tensors were first seen (`walk`: the tree counted)."""
        tied = ()
        if self._aliases:
            modules = dict(walk)
            tied = tuple((joined(self._first[key], _name_of(modules[self._first[key]], key)),
                          *(joined(*where) for where in self._aliases[key]))
                         for key in self._first if key in self._aliases)
        counted = {"streamed": self.streamed, "relocated": self.relocated, "stranded": self.stranded_bytes}
        return Coverage(counted, tuple(self.stranded), tied, self.file_bytes, self.file_modules)


def _name_of(module: nn.Module, key: int) -> str:
    """The first name under which `module` holds the tensor of id `key`."""
    return next(name for tensors in (module._parameters, module._buffers) for name, tensor in tensors.items()
                if id(tensor) == key)


def _named_earlier(tensors: dict, name: str, tensor: object) -> bool:
    """Whether `tensor` is in `tensors` under a name before `name`."""
    for other_name, other in tensors.items():
        if other_name == name:
            return False
        if other is tensor:
            return True
    return False


def _rule_location(rule: Any):
    origin = getattr(rule, "_origin", None)
    if origin is None:
        return None
    source, path = origin
    return source.locate(path + ("select",))


def _rule_problem(code: str, rule: Any, message: str, **extra) -> Diagnostic:
    return Diagnostic(code, message, _rule_location(rule), **extra)


def _conflict(section: str, conflicts: list[RuleConflict]) -> Diagnostic:
    """One diagnostic for a pair of rules that tie at many modules: it names the first module and counts the rest."""
    conflict = conflicts[0]
    first, second = conflict.first, conflict.second
    more = f" (and {len(conflicts) - 1} more modules)" if len(conflicts) > 1 else ""
    return _rule_problem(
        "rule-conflict", second,
        f"rules `{first.id}` and `{second.id}` in [{section}] select `{conflict.module.path or '<root>'}`{more} "
        f"equally specifically but disagree ({first.decision} vs {second.decision})",
        notes=(Note(f"`{first.id}` is here", _rule_location(first)),),
        help="make one of the two rules more specific (an exact path beats a glob, a glob beats a class)",
    )


def _unmatched(matcher: _Matcher, matches: dict[str, int], walk: list) -> list[Diagnostic]:
    """Rules whose selector hits no module: not those outranked everywhere, nor those whose modules are excluded."""
    unmatched = [
        (name, rule) for name, section in matcher.sections.items() for rule, selector in section.rules
        if not rule.optional and not matches[f"{name}.{rule.id}"]
        and not any(selector.matches_module(path, module) for path, module in walk)  # selects some, decides none
    ]
    if not unmatched:
        return []
    classes = sorted({ModuleRef.of(path, module).name for path, module in walk})
    root = ModuleRef.of("", walk[0][1]).name  # a walk starts at the root
    problems = []
    for name, rule in unmatched:
        guess = next(filter(None, (did_you_mean(c.rsplit(".", 1)[-1], classes) for c in rule.select.class_)), None)
        problems.append(_rule_problem(
            "unmatched-rule", rule, f"rule `{rule.id}` in [{name}] matches no module of `{root}`",
            suggestion=guess,
            help="fix the selector, or mark the rule `optional = true` if some models of the family lack these modules",
        ))
    return problems


def _grouped(per_module: list[tuple[Diagnostic, str]]) -> list[Diagnostic]:
    """One diagnostic per distinct problem, naming the modules it was found at (a problem of a class repeats in
    every layer)."""
    paths: dict[Diagnostic, list[str]] = {}
    for problem, path in per_module:
        paths.setdefault(problem, []).append(path or "<root>")
    grouped = []
    for problem, where in paths.items():
        listed = ", ".join(f"`{p}`" for p in where[:_MAX_LISTED])
        more = f", and {len(where) - _MAX_LISTED} more" if len(where) > _MAX_LISTED else ""
        modules = f"{len(where)} modules" if len(where) > 1 else "module"
        grouped.append(dataclasses.replace(problem, message=f"{problem.message} ({modules}: {listed}{more})"))
    return grouped


def _stranded(coverage: Coverage) -> Diagnostic:
    """One warning for every stranded tensor, grouped by the class holding them, with the rule that would cover
    each class."""
    by_class: dict[str, list] = {}
    for tensor in coverage.stranded:
        by_class.setdefault(tensor.owner_class, []).append(tensor)
    groups = []
    for owner, tensors in list(by_class.items())[:_MAX_LISTED]:
        names = sorted({t.name.rsplit(".", 1)[-1] for t in tensors})
        held = sum(t.bytes for t in tensors)
        parameters = any(t.kind == "parameter" for t in tensors)
        rule = (f'[[stream.rule]] kind = "auto", select = {{ class = "{owner}" }}' if parameters
                else f'[[relocate.rule]] select = {{ class = "{owner}" }}')
        groups.append(f"`{owner}` x{len(tensors)} ({', '.join(names)}; {held} bytes), e.g. `{tensors[0].name}`: {rule}")
    more = len(by_class) - _MAX_LISTED
    return Diagnostic(
        "stranded-tensors",
        f"{len(coverage.stranded)} tensors ({coverage.bytes['stranded']} bytes) are handled by no rule; "
        "a partial load would leave them on the offload device",
        severity="warning",
        help="add the rule each class below names, or accept stranding explicitly (allow_stranded)",
        notes=tuple(Note(f"stranded: {group}") for group in groups)  # one each: every class shown whole
        + ((Note(f"and {more} more classes"),) if more > 0 else ()),
    )


def _unused(matcher: _Matcher, matches: dict[str, int], walk: list) -> list[Diagnostic]:
    """Warnings for compile blocks and excludes that select nothing here: they were meant to, or are stale."""
    problems = []
    if matcher.blocks is not None and not matches.get("compile.blocks"):
        problems.append(Diagnostic("unmatched-blocks", "[compile] blocks select no module of this model, so the "
                                   "whole model would be compiled as one graph", severity="warning",
                                   help="fix the selector, or use `blocks = { no_split = true }`"))
    for name, section in matcher.sections.items():
        if section.exclude is not None and not any(section.exclude.matches_module(p, m) for p, m in walk):
            problems.append(Diagnostic("unmatched-exclude", f"[{name}] exclude selects no module of this model",
                                       severity="warning", help="fix the selector, or remove the exclude"))
    return problems
