"""A copy of a module tree to convert, so that the tree it came from stays exactly as it was.

ComfyUI never changes a node's input: a MODEL may feed other branches and workflows. Converting a MODEL another
node made therefore converts a copy: new module objects, each with new Parameter objects over the same storage
(a device move of the copy, which swaps a Parameter's data, leaves the source's in place) and the same buffers, so
memory holds one copy of the weights. Ties (one Parameter, or one module, in two places) stay ties in the copy.

A source Streamwise converted before is copied as it was before: every conversion record is undone on the copy
(classes and attributes back), except quantized residents, whose float weights are gone: they stay residents, which
any policy takes as they are. What the source's tree was loaded with (the weights left in its file, its host budget,
the folder it came from) carries over, the file read through staging of the copy's own; its plan and records do not.
A forward set on one module (a hook's `functools.partial(new_forward, module)`, a bound method) is bound to the
module's copy, so the copy never runs its source.
"""

from __future__ import annotations

import copy
import functools
import types
from collections import OrderedDict

from torch import Tensor, nn

from ..engine import protocol
from ..engine.file_reads import FileTier
from ..engine.file_tier import Sources
from ..engine.journal import Record
from .state import AppliedState, applied_state


def unconverted_copy(model: nn.Module) -> nn.Module:
    """A new tree over `model`'s tensors, as `model` was before Streamwise converted it (residents stay)."""
    copies: dict[int, object] = {}
    copied = _copy_module(model, copies)
    state = applied_state(model)
    if state is None:
        return copied
    for record in reversed(state.records):  # on the copies; a resident keeps every conversion that made it one
        undone = [copies[id(m)] for m in record.modules if not protocol.is_resident(m)]
        Record(undone, record.original_class, record.replaced, record.role)()
    copied.__dict__.pop(protocol.STATE, None)
    residents = [module for module in copied.modules() if protocol.is_resident(module)]
    carried = (state.source, state.tree.file_tier, state.tree.host_budget)
    if residents or any(value is not None for value in carried):  # else the copy is as one never converted
        fresh = AppliedState(source=state.source)
        fresh.tree.file_tier, fresh.tree.host_budget = _tier(state.tree.file_tier, copies), state.tree.host_budget
        for module in residents:
            module.__dict__[protocol.TREE] = fresh.tree
        copied.__dict__[protocol.STATE] = fresh
    return copied


def _copy_module(module: nn.Module, copies: dict[int, object]) -> nn.Module:
    if id(module) in copies:
        return copies[id(module)]
    twin = object.__new__(type(module))
    copies[id(module)] = twin
    twin.__dict__.update({name: _own(value, module, twin, copies) for name, value in module.__dict__.items()})
    twin._parameters = {name: _shared(p, copies) for name, p in module._parameters.items()}
    twin._buffers = dict(module._buffers)
    twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    twin._modules = {name: None if child is None else _copy_module(child, copies)
                     for name, child in module._modules.items()}
    return twin


def _own(value: object, module: nn.Module, twin: nn.Module, copies: dict[int, object]) -> object:
    """An attribute of `module` as its copy `twin` holds it: a container (hook tables, a weight-function list) of
    its own, a callable bound to `module` bound to `twin`, its file-tier sources read through the copy's tier;
    else `value`."""
    if type(value) in (dict, OrderedDict, list, set):
        return type(value)(value)
    if isinstance(value, Sources):  # a dtype cast of the copy rewrites its own record, never the source's
        return Sources(_tier(value.tier, copies), dict(value.tensors))
    if isinstance(value, types.MethodType) and value.__self__ is module:
        return types.MethodType(value.__func__, twin)
    if isinstance(value, functools.partial) and value.args and value.args[0] is module:
        rebound = functools.partial(value.func, twin, *value.args[1:], **value.keywords)
        rebound.__dict__.update(value.__dict__)  # what `functools.update_wrapper` gave it (`__wrapped__`, names)
        return rebound
    return value


def _tier(tier: FileTier | None, copies: dict[int, object]) -> FileTier | None:
    """The copy's reads of the file `tier` reads: staging and read-ahead of its own (one per source tier)."""
    if tier is None:
        return None
    if id(tier) not in copies:
        copies[id(tier)] = copy.copy(tier)
    return copies[id(tier)]


def _shared(parameter: Tensor | None, copies: dict[int, object]) -> Tensor | None:
    """A new Parameter over `parameter`'s storage (a stand-in's alias for one left in its file), once per source."""
    if parameter is None:
        return None
    if id(parameter) not in copies:
        copies[id(parameter)] = nn.Parameter(parameter.detach(), requires_grad=parameter.requires_grad)
    return copies[id(parameter)]
