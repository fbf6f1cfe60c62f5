"""Choosing the policy for a tree: by name or path, or `auto`, the strongest `[match]` whose plan fits.

`auto` ranks the policies that recognize the tree, strongest first: the root class is in `classes`, the config's
`model_type` is in `model_types`, every glob of `state_dict_keys` matches a key of the tree, a class of the root's MRO
is in `base_classes` (a library's fallback, such as `transformers`), or the policy is a `fallback` (any module). A
candidate wins only if its plan fits: it resolves with no error and strands no tensor. Otherwise the next candidate
by strength is tried, down to the fallback, and the reason names each candidate passed over and why. Two fitting
candidates of equal strength are an error naming both, never a silent pick.

The keys are the tree's own (its parameters and persistent buffers), never a file's: a model built in memory and the
same model loaded from its files get the same policy and the same plan.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from ...schemas import Policy
from ...schemas.patterns import compile_glob, glob_matches
from ..policy.diagnostics import Diagnostic, PolicyError
from ..policy.folders import list_policies, policy_dirs
from ..policy.load import as_policy, check_policy
from ..policy.source import display_path
from ..sizes import human
from .plan import Plan
from .resolve import resolve_with_modules
from .selectors import ModuleRef, walk_modules

#: The policy "name" that asks for selection by `[match]` (nodes, `load_pretrained`, `model_patcher`).
AUTO = "auto"
#: The ways a policy's `[match]` recognizes a tree, strongest first: the root's class, the config's model_type,
#: state-dict key patterns, a base class, the fallback.
STRENGTHS = ("class", "model_type", "keys", "base class", "fallback")


@dataclass(frozen=True)
class Choice:
    """The policy chosen for a tree, why in words, and (for `auto`) the plan resolved while choosing."""

    policy: Policy
    reason: str
    resolved: tuple[Plan, list[nn.Module]] | None = field(default=None, repr=False)
    """The fitting plan and the module of each of its entries: the caller applies it without resolving again."""
    skipped: tuple[str, ...] = ()
    """Policy files `auto` could not read and was told to skip (`skip_unreadable`), by path as diagnostics show one
    (`display_path`)."""


def plan_for(
    policy: Policy | str | os.PathLike[str], model: nn.Module, *, dirs: Iterable[str | os.PathLike] = ()
) -> tuple[Policy, Plan]:
    """The policy (loaded when given a name or path, chosen for `"auto"`) and its plan for `model`; PolicyError
    unless the plan is ok."""
    policy, plan, _ = plan_and_modules(policy, model, dirs=dirs)
    return policy, plan


def plan_and_modules(
    policy: Policy | str | os.PathLike[str], model: nn.Module, *, dirs: Iterable[str | os.PathLike] = ()
) -> tuple[Policy, Plan, list[nn.Module]]:
    """`plan_for`, and the module each plan entry names, in order: an apply that follows at once needs no walk."""
    choice = choose_policy(policy, model, dirs=dirs)
    plan, modules = choice.resolved or resolve_with_modules(choice.policy, model)
    if not plan.ok:
        raise PolicyError(plan.diagnostics)
    return choice.policy, plan, modules


def choose_policy(
    policy: Policy | str | os.PathLike[str], model: nn.Module, *, model_type: str | None = None,
    dirs: Iterable[str | os.PathLike] = (), skip_unreadable: bool = False,
) -> Choice:
    """`select_policy` for `"auto"`, else `policy` loaded by name or path.

    Without `model_type`, the model's own `config.model_type` is read when it has one (transformers models).
    """
    if isinstance(policy, str) and policy == AUTO:
        return select_policy(model, model_type=model_type, dirs=dirs, skip_unreadable=skip_unreadable)
    policy = as_policy(policy, dirs=dirs)
    return Choice(policy, f"policy `{policy.name}`")


def select_policy(
    model: nn.Module, *, model_type: str | None = None, keys: Iterable[str] | None = None,
    dirs: Iterable[str | os.PathLike] = (), skip_unreadable: bool = False,
) -> Choice:
    """The strongest fitting candidate for `model`; PolicyError when none fits, or two of equal strength do.

    A policy file that does not parse or validate is never passed over in silence: its `[match]` cannot be read, so
    it cannot be known not to be meant for this model. It is a PolicyError with its located diagnostics, unless
    `skip_unreadable`, and then the choice names it (`Choice.skipped`).
    `keys` stands in for the tree's own state-dict keys (a caller matching a bare module against a file's names).
    """
    if model_type is None:
        found = getattr(vars(model).get("config"), "model_type", None)
        model_type = found if isinstance(found, str) else None
    root = ModuleRef.of("", model)
    ranked, unreadable = _candidates(model, root, model_type, None if keys is None else list(keys), dirs)
    if unreadable and not skip_unreadable:
        raise PolicyError([*(d for diagnostics in unreadable.values() for d in diagnostics if d.is_error), Diagnostic(
            "unreadable-policy", f"`auto` cannot choose a policy for `{root.name}` while "
            f"{len(unreadable)} policy file(s) cannot be read: {', '.join(unreadable)}",
            help="fix or remove the file, choose a policy by name, or skip unreadable policies (the nodes' "
                 "`skip_unreadable_policies` input, `skip_unreadable=True`)",
        )])
    skipped = tuple(unreadable)
    passed: list[str] = []
    for strength in STRENGTHS:
        fitting = []
        for policy, how in ranked.get(strength, ()):
            plan, modules = resolve_with_modules(policy, model)
            misfit = _misfit(plan)
            if misfit is None:
                fitting.append((policy, how, plan, modules))
            else:
                passed.append(f"`{policy.name}` (by {how}): {misfit}")
        if len(fitting) > 1:
            names = ", ".join(f"`{policy.name}`" for policy, *_ in fitting)
            raise PolicyError([Diagnostic(
                "rule-conflict", f"policies {names} all match `{root.name}` by {fitting[0][1]} and fit it; "
                "choose one by name",
            )])
        if fitting:
            [(policy, how, plan, modules)] = fitting
            over = f"; passed over {'; '.join(passed)}" if passed else ""
            over += f"; skipped unreadable {', '.join(skipped)}" if skipped else ""
            return Choice(policy, f"`auto` picked `{policy.name}` by {how}{over}", (plan, modules), skipped)
    tried = f": {'; '.join(passed)}" if passed else ""
    raise PolicyError([Diagnostic(
        "unknown-policy", f"no policy fits `{root.name}`{tried}",
        help="choose a policy by name, or write one (`streamwise policy draft` starts from the model)",
    )])


def _candidates(
    model: nn.Module, root: ModuleRef, model_type: str | None, keys: list[str] | None,
    dirs: Iterable[str | os.PathLike],
) -> tuple[dict[str, list[tuple[Policy, str]]], dict[str, list[Diagnostic]]]:
    """Every policy whose `[match]` recognizes the tree, by its strongest way of recognizing it (`STRENGTHS`), with
    how; and the diagnostics of every policy file that cannot be read, by path as they show it."""
    short, qualified = root.name, root.qualname
    ranked: dict[str, list[tuple[Policy, str]]] = {}
    unreadable: dict[str, list[Diagnostic]] = {}
    for path in list_policies(policy_dirs(dirs)).values():
        policy, diagnostics = check_policy(path, dirs=dirs)
        if policy is None:
            unreadable[display_path(path)] = diagnostics  # as its diagnostics name it
            continue
        match = policy.match
        if match.state_dict_keys and keys is None:
            keys = tree_keys(model)  # once, and only when some policy matches by keys
        if short in match.classes or qualified in match.classes:
            ranked.setdefault("class", []).append((policy, f"root class `{short}`"))
        elif model_type is not None and model_type in match.model_types:
            ranked.setdefault("model_type", []).append((policy, f"model_type `{model_type}`"))
        elif match.state_dict_keys and _all_match(match.state_dict_keys, keys):
            ranked.setdefault("keys", []).append((policy, "its state-dict key patterns"))
        elif base := next((c for names in root.classes for c in names if c in match.base_classes), None):
            how = f"base class `{base.rpartition('.')[2]}`, no family policy"
            ranked.setdefault("base class", []).append((policy, how))
        elif match.fallback:
            ranked.setdefault("fallback", []).append((policy, "fallback: no other policy recognizes it"))
    return ranked, unreadable


def _all_match(patterns: Iterable[str], keys: list[str]) -> bool:
    """Whether every glob matches at least one key."""
    return bool(keys) and all(any(glob_matches(pattern, key) for key in keys)
                              for pattern in map(compile_glob, patterns))


def tree_keys(model: nn.Module) -> list[str]:
    """The tree's state-dict keys (parameters and persistent buffers), read without calling `state_dict()`."""
    keys = []
    for path, module in walk_modules(model):
        prefix = path + "." if path else ""
        keys += [prefix + name for name, tensor in module._parameters.items() if tensor is not None]
        transient = module._non_persistent_buffers_set
        keys += [prefix + name for name, tensor in module._buffers.items()
                 if tensor is not None and name not in transient]
    return keys


def _misfit(plan: Plan) -> str | None:
    """Why a candidate's plan does not fit its tree, in a few words (None: it fits)."""
    errors = [d for d in plan.diagnostics if d.is_error]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        return f"error[{first.code}]: {first.message}{more}"
    stranded = plan.coverage.stranded
    if stranded:
        return (f"strands {len(stranded)} tensors ({human(plan.coverage.bytes['stranded'])}), "
                f"e.g. `{stranded[0].name}`")
    return None
