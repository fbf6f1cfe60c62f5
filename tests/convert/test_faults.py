"""Every failure restores: `apply` (quantizing included), `revert`, `offload` and `load` either complete or leave the
tree exactly as it was, whichever call inside them fails, with an error or an interrupt.

Each sweep counts the calls a successful run makes to the functions these operations change the tree through
(tensor moves, quantize, class swaps, attribute setters, residents, placement, checkpoint reads), then fails the
N-th of them for many N, once with a MemoryError and once with a KeyboardInterrupt, and compares a full snapshot of
the tree: every module's class and instance attributes (by identity), every parameter and buffer (identity, storage,
device, dtype, values) and the root's state.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streamwise
from streamwise.runtime.checkpoint import fill
from streamwise.runtime.checkpoint.readers import CheckpointError
from streamwise.runtime.convert import ConversionError, applied_state
from streamwise.runtime.engine import journal as journal_module
from streamwise.runtime.engine import protocol
from streamwise.runtime.engine.journal import Journal
from streamwise.runtime.hosts import standalone
from streamwise.runtime.hosts.standalone import OffloadError
from streamwise.runtime.quant import residents
from streamwise.runtime.quant.formats import FORMATS

from helpers import make_policy, tiny_qwen2

apply_module = importlib.import_module("streamwise.runtime.convert.apply")  # the package exports a function `apply`

SIZE = dict(hidden_size=32, intermediate_size=64, vocab_size=64)


def small():
    torch.manual_seed(0)
    return tiny_qwen2(**SIZE)


def quantizing_policy():
    """decoder-llm, with every Linear quantized to int8 on apply."""
    rules = make_policy(quant={"rule": [{"id": "q", "select": {"class": "Linear"}, "format": "int8"}]})
    return streamwise.load_policy("decoder-llm").model_copy(update={"quant": rules.quant})


def snapshot(model: torch.nn.Module) -> list:
    """What a failed operation must leave as it found: objects by identity, tensors by storage and value."""
    taken = []
    for name, module in model.named_modules(remove_duplicate=False):
        tensors = [
            (slot, key, t, t.data_ptr(), t.device, t.dtype, t.requires_grad, None if t.is_meta else t.detach().clone())
            for slot in ("_parameters", "_buffers") for key, t in getattr(module, slot).items() if t is not None
        ]
        held = (dict(module.__dict__), dict(module._parameters), dict(module._buffers), dict(module._modules))
        taken.append((name, type(module), held, tensors))
    state = applied_state(model)
    if state is not None:
        records = [(list(r.modules), r.original_class, r.replaced if isinstance(r.replaced, tuple)
                    else dict(r.replaced), r.role) for r in state.records]
        taken.append(("<state>", state, dict(vars(state)), dict(vars(state.tree)), records))
    return taken


def differences(before: list, after: list) -> list[str]:
    if len(before) != len(after):
        return [f"{len(before)} entries before, {len(after)} after"]
    found = []
    for old, new in zip(before, after, strict=True):
        if old[0] == "<state>" or new[0] == "<state>":
            if old[0] != new[0] or old[1] is not new[1] or not _same(old[2:4], new[2:4]) or old[4] != new[4]:
                found.append("the root state differs")
            continue
        name, cls, held, tensors = old
        if new[0] != name or new[1] is not cls:
            found.append(f"`{name}`: class {cls.__name__} became {new[1].__name__}")
        if not _same(held, new[2]):
            found.append(f"`{name}`: instance attributes differ")
        if len(tensors) != len(new[3]):
            found.append(f"`{name}`: tensors differ")
            continue
        for was, now in zip(tensors, new[3], strict=True):
            values = was[7] is None or (now[7] is not None and torch.equal(was[7], now[7]))
            if was[:2] != now[:2] or was[2] is not now[2] or was[3:7] != now[3:7] or not values:
                found.append(f"`{name}.{was[1]}` differs")
    return found


def _same(old, new) -> bool:
    """Containers of the same shape holding the very same objects."""
    if isinstance(old, dict):
        return isinstance(new, dict) and old.keys() == new.keys() and all(_same(old[k], new[k]) for k in old)
    if isinstance(old, tuple):
        return isinstance(new, tuple) and len(old) == len(new) and all(map(_same, old, new))
    return old is new


class Faults:
    """Counts the calls of the patched functions, all together; the `fail_at`-th raises `error`."""

    def __init__(self, monkeypatch, targets) -> None:
        self.calls, self.fail_at, self.error = 0, None, None
        for owner, name in targets:
            monkeypatch.setattr(owner, name, self.counted(getattr(owner, name)))

    def counted(self, real):
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                raise self.error
            return real(*args, **kwargs)

        return call

    def arm(self, fail_at=None, error=None) -> None:
        self.calls, self.fail_at, self.error = 0, fail_at, error


def points(count: int) -> list[int]:
    """Every call up to 40, then about 25 more spread over the rest (the last one included)."""
    dense = list(range(1, min(count, 40) + 1))
    return dense + list(range(41, count, max(1, (count - 40) // 25))) + ([count] if count > 40 else [])


def sweep(faults: Faults, build, run, own_errors: tuple[type, ...]) -> tuple[int, list[str]]:
    """Fail each point of a successful run's calls with an error and an interrupt; return how many points were
    tried and what each broken one left."""
    faults.arm()
    run(build())
    count = faults.calls
    assert count > 0
    model, broken = build(), []
    for point in points(count):
        for error in (MemoryError("out of memory"), KeyboardInterrupt()):
            before = snapshot(model)
            faults.arm(point, error)
            with pytest.raises(BaseException) as raised:
                run(model)
            if isinstance(error, KeyboardInterrupt):
                assert raised.value is error, point  # an interrupt comes back unchanged
            else:
                assert isinstance(raised.value, own_errors), (point, raised.value)
                cause = raised.value
                while cause is not None and cause is not error:
                    cause = cause.__cause__
                assert cause is error, (point, raised.value)
            found = differences(before, snapshot(model))
            if found:
                broken.append(f"call {point} ({type(error).__name__}): {found[:3]}")
                model = build()
    return len(points(count)), broken


CONVERTING = [
    (apply_module, "swap_class"), (journal_module, "swap_class"), (apply_module, "streaming_class"),
    (Journal, "set_tensor"), (Journal, "keep"), (residents, "make_resident"), (residents, "resident_class"),
    (protocol, "leaf_attributes"), (FORMATS["int8"], "quantize"),
]


def test_apply_with_quantization_completes_or_restores(monkeypatch):
    faults = Faults(monkeypatch, CONVERTING)
    policy = quantizing_policy()
    tried, broken = sweep(faults, small, lambda model: streamwise.apply_policy(model, policy), (ConversionError,))
    assert tried >= 40 and not broken, broken


def test_revert_completes_or_leaves_the_tree_converted_and_revertible(monkeypatch):
    def converted():
        model = small()
        streamwise.apply_policy(model, "decoder-llm")
        return model

    faults = Faults(monkeypatch, [(Journal, "restore"), (journal_module.Record, "__call__")])
    tried, broken = sweep(faults, converted, streamwise.revert, (ConversionError,))
    assert tried >= 8 and not broken, broken  # a class's modules share one record: a call each, not one per module

    original = small()
    before, model = snapshot(original), original
    streamwise.apply_policy(model, "decoder-llm")
    faults.arm(7, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        streamwise.revert(model)
    assert applied_state(model) is not None
    faults.arm()
    streamwise.revert(model)  # a second revert after an interrupted one
    assert not differences(before, snapshot(model)) and applied_state(model) is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="moves between devices need CUDA"))])
def test_offload_completes_or_restores(monkeypatch, device):
    faults = Faults(monkeypatch, [
        *CONVERTING, (journal_module, "move_in_place"), (standalone, "_place"), (standalone, "_residency"),
        (standalone, "_units"), (standalone, "fetcher_for"), (protocol, "set_fetching"),
    ])
    budget = 40_000  # some leaves resident, the others streamed

    def run(model):
        streamwise.offload(model, quantizing_policy(), device=device, budget=budget)

    tried, broken = sweep(faults, small, run, (OffloadError, ConversionError))
    assert tried >= 40 and not broken, broken


@pytest.mark.parametrize("arguments, message", [
    (dict(device="meta"), "holds no data"),
    (dict(device="cpu", offload_device="meta"), "holds no data"),
    (dict(device="nowhere"), "not a device"),
    (dict(device="cpu", budget="1 gig"), "write bytes with a unit"),
    (dict(device="cpu", budget="-1GB"), "write bytes with a unit"),
    (dict(device="cpu", budget="150%"), "from 0% to 100%"),
    (dict(device="cpu", budget="x%"), "from 0% to 100%"),
    (dict(device="cpu", budget=0.5), "written '50%'"),
    (dict(device="cpu", budget=True), "a number of bytes"),
    (dict(device="cpu", budget=-1), "not negative"),
    (dict(device="cpu", budget=float("nan")), "finite"),
    (dict(device="cpu", budget=float("inf")), "finite"),
    pytest.param(dict(device="cuda"), "no usable cuda", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                                  reason="CUDA is here")),
])
def test_offload_refuses_what_it_cannot_place_with_and_changes_nothing(arguments, message):
    model = small()
    before = snapshot(model)
    with pytest.raises(OffloadError, match=message):
        streamwise.offload(model, "decoder-llm", **arguments)
    assert not differences(before, snapshot(model))


def test_offload_of_a_converted_tree_restores_it_converted(monkeypatch):
    """A tree converted before (here by apply) stays converted, with its tree state, when offloading fails."""
    faults = Faults(monkeypatch, [(standalone, "_place"), (protocol, "set_fetching"), (standalone, "_units")])

    def converted():
        model = small()
        streamwise.apply_policy(model, "decoder-llm")
        return model

    def run(model):
        streamwise.offload(model, "decoder-llm", device="cpu", budget=40_000)

    tried, broken = sweep(faults, converted, run, (OffloadError,))
    assert tried >= 20 and not broken, broken


def test_load_completes_or_restores(monkeypatch, tmp_path):
    small().save_pretrained(tmp_path)
    real_open = fill.open_checkpoint

    def opened(path, dtype=None):  # every tensor read goes through the counted functions too
        checkpoint = real_open(path, dtype)
        checkpoint.tensors = {name: dataclasses.replace(stored, read=faults.counted(stored.read))
                              for name, stored in checkpoint.tensors.items()}
        return checkpoint

    faults = Faults(monkeypatch, [*CONVERTING, (fill, "make_resident"), (fill, "apply"), (fill._Filling, "assign")])
    monkeypatch.setattr(fill, "open_checkpoint", opened)
    progress = faults.counted(lambda done, total: None)  # the caller's callback may fail too

    def skeleton():
        with streamwise.skeleton():
            return tiny_qwen2(**SIZE)

    def run(model):
        streamwise.load(model, tmp_path, quantizing_policy(), progress=progress)

    tried, broken = sweep(faults, skeleton, run, (CheckpointError, ConversionError))
    assert tried >= 40 and not broken, broken


def test_a_journal_moves_a_parameter_back_as_the_same_object():
    layer = torch.nn.Linear(4, 4)
    weight, buffer = layer.weight, torch.zeros(2)
    layer.register_buffer("offset", buffer)
    journal = Journal()
    journal.move(layer, "weight", torch.device("cpu"))
    journal.move(layer, "offset", torch.device("cpu"))
    journal.rollback()
    assert layer.weight is weight and layer.offset is buffer


# --- two threads, one model ----------------------------------------------------------------------------------------

OPERATIONS = {
    "apply": lambda model: streamwise.apply_policy(model, "decoder-llm"),
    "revert": streamwise.revert,
    "offload": lambda model: streamwise.offload(model, "decoder-llm", device="cpu", budget=40_000),
}
NOT_CONVERTED = "this model was not converted"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(sorted(OPERATIONS)), min_size=1, max_size=3),
       st.lists(st.sampled_from(sorted(OPERATIONS)), min_size=1, max_size=3))
def test_two_threads_leave_one_model_converted_once_or_as_it_was(first, second):
    """apply, revert and offload of one root, from two threads at once with the interpreter switching threads as
    often as it can: every call completes (a revert may find nothing to revert), and the tree ends converted once
    (the counts of one apply, and one revert restores it exactly) or exactly as it was."""
    once = small()
    converted_once = streamwise.apply_policy(once, "decoder-llm")[1] and applied_state(once).counts()
    model = small()
    original = snapshot(model)
    start, failures = threading.Barrier(2), []

    def run(operations):
        start.wait()
        for name in operations:
            try:
                OPERATIONS[name](model)
            except ConversionError as exc:
                if name != "revert" or NOT_CONVERTED not in str(exc):
                    failures.append(f"{name}: {exc!r}")
            except Exception as exc:  # anything else is a failure the test reports
                failures.append(f"{name}: {exc!r}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(ops,)) for ops in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures
    if applied_state(model) is not None:
        assert applied_state(model).counts() == converted_once
        streamwise.revert(model)
    assert not differences(original, snapshot(model))
