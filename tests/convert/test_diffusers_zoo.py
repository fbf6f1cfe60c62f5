"""The diffusers zoo: every model class diffusers exports that builds from its default config converts with no
hand-written policy.

Every `ModelMixin` subclass in `dir(diffusers)`, built on the `meta` device from its default config (full size, which
costs nothing there); the policy picked by `auto`, the plan resolved: no plan error and no stranded byte, for each one.
A class whose default config does not build (a required argument, `None` where its code needs a number) is not a
Streamwise failure; the test asserts that most build, so it cannot pass vacuously. The builds run in a pool of worker
processes forked after diffusers imported every model module once.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

diffusers = pytest.importorskip("diffusers")


def zoo_names() -> list[str]:
    names = []
    for name in dir(diffusers):
        try:
            cls = getattr(diffusers, name)
        except Exception:  # a pipeline whose optional dependency is missing: no model class
            continue
        if isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin) and cls is not diffusers.ModelMixin:
            names.append(name)
    return names


def convert_on_meta(name: str) -> tuple[str, str, str]:
    """(name, outcome, detail): `built` with the policy `auto` picked and the problems found, or `no-build`."""
    import torch

    import streamwise
    from streamwise.runtime.plan.auto import select_policy

    cls = getattr(diffusers, name)
    try:
        with torch.device("meta"):
            model = cls()
    except Exception as exc:  # the library's default config does not build: not ours to judge
        return name, "no-build", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    try:
        policy = select_policy(model).policy
    except Exception as exc:  # no policy fits: the reasons, as text (a PolicyError does not cross processes)
        return name, "built", f"?|{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"
    plan = streamwise.resolve(policy, model)
    problems = [f"{d.code}: {d.message[:200]}" for d in plan.diagnostics if d.is_error]
    if plan.coverage.bytes["stranded"]:
        problems.append(f"stranded {plan.coverage.bytes['stranded']} bytes: {plan.coverage.stranded[0].name}")
    return name, "built", f"{policy.name}|" + "; ".join(problems)


@pytest.fixture(scope="module")
def zoo() -> list[tuple[str, str, str]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = zoo_names()  # imports every model module here, before the fork
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), mp_context=context) as pool:
        return list(pool.map(convert_on_meta, names, chunksize=4))


def test_every_diffusers_model_that_builds_converts_by_auto_with_nothing_stranded(zoo):
    built = [(name, detail) for name, outcome, detail in zoo if outcome == "built"]
    failed = [(name, detail) for name, detail in built if detail.split("|", 1)[1]]
    assert failed == []
    assert len(built) >= 0.8 * len(zoo) and len(built) >= 120, f"only {len(built)} of {len(zoo)} built"


def test_auto_picks_the_generic_policy_for_diffusers(zoo):
    fitting = [detail for _, outcome, detail in zoo if outcome == "built" and not detail.split("|", 1)[1]]
    assert fitting and {detail.split("|", 1)[0] for detail in fitting} == {"any-module"}
