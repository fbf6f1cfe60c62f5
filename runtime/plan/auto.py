"""`auto` policy selection: which policy's `[match]` table recognizes a model.

A policy matches, strongest first, when the model's root class is in `classes`, its config's
`model_type` is in `model_types`, every glob in `state_dict_keys` matches some checkpoint key, a
class of the root's MRO is in `base_classes` (a library's fallback, such as `transformers`), or it
is a `fallback` (any module). The strongest match wins; two policies matching equally strongly is
an error that names both, rather than a silent pick.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from torch import nn

from ...schemas import Policy
from ...schemas.patterns import compile_glob, glob_matches
from ..policy.diagnostics import Diagnostic, PolicyError
from ..policy.folders import list_policies, policy_dirs
from ..policy.load import as_policy, check_policy
from .selectors import ModuleRef

#: The policy "name" that asks for selection by `[match]` (nodes, `load_pretrained`, `model_patcher`).
AUTO = "auto"


def choose_policy(
    policy: Policy | str | os.PathLike[str], model: nn.Module, *, model_type: str | None = None,
    keys: Iterable[str] = (), dirs: Iterable[str | os.PathLike] = (),
) -> tuple[Policy, str]:
    """(the policy, how it was chosen): `select_policy` for `"auto"`, else `policy` loaded by name or path.

    Without `model_type`, the model's own `config.model_type` is read when it has one (transformers models).
    """
    if isinstance(policy, str) and policy == AUTO:
        if model_type is None:
            found = getattr(vars(model).get("config"), "model_type", None)
            model_type = found if isinstance(found, str) else None
        return select_policy(model, model_type=model_type, keys=keys, dirs=dirs)
    policy = as_policy(policy, dirs=dirs)
    return policy, f"policy `{policy.name}`"


def select_policy(
    model: nn.Module, *, model_type: str | None = None, keys: Iterable[str] = (), dirs: Iterable[str | os.PathLike] = ()
) -> tuple[Policy, str]:
    """(the loaded policy, why it was picked) for `model`; PolicyError when none or several fit.

    Every candidate is loaded to read its `[match]`; the winner is returned loaded, not loaded again.
    """
    root = ModuleRef.of("", model)
    short, qualified = root.name, root.qualname
    keys = list(keys)
    scored: dict[int, list[tuple[Policy, str]]] = {}
    for path in list_policies(policy_dirs(dirs)).values():
        policy, _ = check_policy(path, dirs=dirs)
        if policy is None:
            continue
        match = policy.match
        if short in match.classes or qualified in match.classes:
            scored.setdefault(5, []).append((policy, f"root class `{short}`"))
        elif model_type is not None and model_type in match.model_types:
            scored.setdefault(4, []).append((policy, f"model_type `{model_type}`"))
        elif match.state_dict_keys and keys and all(
            any(glob_matches(pattern, k) for k in keys) for pattern in map(compile_glob, match.state_dict_keys)
        ):
            scored.setdefault(3, []).append((policy, "its state-dict key patterns"))
        elif base := next((c for names in root.classes for c in names if c in match.base_classes), None):
            scored.setdefault(2, []).append((policy, f"base class `{base.rsplit('.', 1)[-1]}`, no family policy"))
        elif match.fallback:
            scored.setdefault(1, []).append((policy, "fallback: no other policy recognizes it"))
    if not scored:
        raise PolicyError([Diagnostic(
            "unknown-policy", f"no policy's [match] recognizes `{short}`; choose a policy by name",
        )])
    best = scored[max(scored)]
    if len(best) > 1:
        names = ", ".join(f"`{p.name}`" for p, _ in best)
        raise PolicyError([Diagnostic(
            "rule-conflict", f"policies {names} all match `{short}` by {best[0][1]}; choose one by name",
        )])
    policy, reason = best[0]
    return policy, f"`auto` picked `{policy.name}` by {reason}"
