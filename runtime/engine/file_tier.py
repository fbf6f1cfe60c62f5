"""The file tier: weights that stay in their checkpoint file until their unit is fetched.

A tensor on the file tier is a `FileTensor`: a stand-in (`stand_in`) of its dtype and shape on the host, so model
code reading `.dtype` or `.shape` sees the real ones and a direct read (`F.linear(x, m.weight)`) reads its values from
the file; its `FileSource` is also recorded on its module (`protocol.SOURCES`), with the tree's reads
(`file_reads.FileTier`), which a fetch reads a unit through (`held`). A file changed under the model is the reader's
`CheckpointError` at the fetch that reads it, never a signal: nothing of the file is mapped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from . import protocol
from .stand_in import StandIn, applied_dtype

if TYPE_CHECKING:  # the journal moves tensors through `tree`, which reads through this module
    from .file_reads import FileTier
    from .journal import Journal


class FileRange(Protocol):
    """A tensor's bytes in a checked file (the checkpoint stage's `FileRange`)."""

    file: object  # has read_into(ranges), advise(spans) and verify(): the checkpoint stage's CheckedFile
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileSource:
    """Where a tensor of the model can be read back from: its file range, and the dtype and shape it has in the
    model (a float cast at the fetch where they differ from the file's; uint8 is a resident's raw storage)."""

    range: FileRange
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The bytes it takes in memory, in the model's dtype."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def uncast(self) -> bool:
        """Whether the model's tensor is the file's bytes as they are: its dtype, or a resident's raw storage."""
        return self.dtype == self.range.dtype or self.dtype == torch.uint8

    def as_model_tensor(self, raw: Tensor) -> Tensor:
        """The model's tensor from the range's raw bytes (`raw`, uint8)."""
        if self.dtype == torch.uint8 and self.range.dtype != torch.uint8:  # a resident keeps the raw storage
            return raw.reshape(self.shape)
        values = raw.view(self.range.dtype).reshape(self.range.shape)
        return values if values.dtype == self.dtype else values.to(self.dtype)

    def read(self) -> Tensor:
        """The model's tensor, read from the file into memory of its own."""
        raw = torch.empty(self.range.nbytes, dtype=torch.uint8)
        self.range.file.read_into([(self.range.offset, raw)])
        return self.as_model_tensor(raw)

    def placeholder(self, like: Tensor) -> Tensor:
        """What the module holds in place of `like` while it is on the file tier: its `FileTensor`, a Parameter
        where `like` is one."""
        tensor = FileTensor(self)
        if isinstance(like, nn.Parameter):
            return nn.Parameter(tensor, requires_grad=like.requires_grad)
        return tensor


class FileTensor(StandIn):
    """A tensor on the file tier as model code sees it: its model dtype and shape, on the host."""

    @staticmethod
    def __new__(cls, source: FileSource):
        tensor = StandIn.__new__(cls, source.shape, source.dtype, "cpu")
        tensor.source = source
        return tensor

    def values(self, device: torch.device | None) -> Tensor:
        value = self.source.read()  # the checked read: a changed file is a CheckpointError naming it
        return value if device is None else value.to(device)

    def alias(self) -> FileTensor:
        return FileTensor(self.source)

    def describe(self) -> str:
        return f"in the file tier ({self.source.range.file.path}, at byte {self.source.range.offset})"

    def remedy(self) -> str:
        return "load the weights into memory first (a host budget that holds them)"


def in_memory(tensor: Tensor) -> bool:
    """Whether `tensor` holds values in memory: neither on the file tier nor on `meta`."""
    return not tensor.is_meta and not isinstance(tensor, FileTensor)


@dataclass(frozen=True)
class Sources:
    """What `protocol.SOURCES` holds on a module: its tensors that can go back to their file, and the tree's reads
    (a generic container's claimed descendants are no converted modules, yet read through it)."""

    tier: FileTier
    tensors: dict[str, FileSource]


def read_back(module: nn.Module, name: str, read: dict[int, Tensor] | None = None) -> Tensor:
    """The value of a file-tier tensor, read into memory of its own (a Parameter where its placeholder is one).
    `read`: what one placing read back so far, by placeholder: a tensor tied across modules (an embedding and its
    head share one placeholder) is read once and stays one tensor."""
    source, placeholder = sources(module)[name], module._parameters[name]
    if read is not None and id(placeholder) in read:
        return read[id(placeholder)]
    value = source.read()
    if isinstance(placeholder, nn.Parameter):
        value = nn.Parameter(value, requires_grad=placeholder.requires_grad)
    if read is not None:
        read[id(placeholder)] = value
    return value


def leave_in_file(journal: Journal, module: nn.Module, made: dict[int, Tensor] | None = None) -> None:
    """Put a module's tensors back in their file: each becomes its `FileTensor` (those there already stay). `made`:
    the placeholders one placing made so far, by the tensor they replace: a tensor tied across modules becomes one
    placeholder, still tied."""
    made = {} if made is None else made
    for name, source in sources(module).items():
        tensor = module._parameters.get(name)
        if tensor is not None and not isinstance(tensor, FileTensor):
            source.range.file.verify()  # a file changed since the load could not give the same values back
            placeholder = made.get(id(tensor))
            if placeholder is None:
                placeholder = made[id(tensor)] = source.placeholder(tensor)
            journal.set_tensor(module, name, placeholder)


def leave_tree_in_file(journal: Journal, model: nn.Module) -> int:
    """Put every streamed leaf of `model` whose tensors (and those it claims) can all be read back from their file
    there, fetching from then on: what a host does with a model it keeps but no longer runs, to give its host memory
    back (its tier's staging too: `FileTier.drop_staging`). The bytes given back."""
    given, made = 0, {}
    for leaf in model.modules():
        owners = [leaf, *protocol.claimed(leaf)]
        held = [(owner, name, tensor) for owner in owners for name, tensor in owner._parameters.items()
                if tensor is not None and in_memory(tensor)]
        if protocol.kind_of(leaf) is None or not held or any(name not in sources(owner) for owner, name, _ in held):
            continue
        fresh = {id(tensor): tensor for _, _, tensor in held if id(tensor) not in made}  # a tied one counts once
        for owner in owners:
            leave_in_file(journal, owner, made)
        journal.keep(leaf, (protocol.FETCH_FLAG,))
        protocol.set_fetching(leaf, True)
        given += sum(tensor.nbytes for tensor in fresh.values())
    return given


def sources(module: nn.Module) -> dict[str, FileSource]:
    """The tensors of `module` that can go back to their file, by attribute name."""
    record = module.__dict__.get(protocol.SOURCES)
    return record.tensors if record is not None else {}


def on_file_tier(module: nn.Module, name: str) -> bool:
    tensor = module._parameters.get(name, module._buffers.get(name))
    return isinstance(tensor, FileTensor) and name in sources(module)


def in_file(module: nn.Module) -> bool:
    """Whether some tensor of `module` (its own, not its children's) is on the file tier now."""
    record = module.__dict__.get(protocol.SOURCES)
    return record is not None and any(on_file_tier(module, name) for name in record.tensors)


@contextmanager
def kept_in_file(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Around torch's `_apply(fn)` of `module` (`.to()`, `.half()`, a host's device move): the file-tier
    placeholders of its subtree are set aside, so a device move neither reads a file nor fails on a meta tensor (a
    fetch brings them to the compute device); a dtype cast `fn` makes becomes their model dtype, applied at each
    fetch as a load's `dtype=` is."""
    aside = []
    for owner in module.modules():
        record = owner.__dict__.get(protocol.SOURCES)
        for name in (record.tensors if record is not None else ()):
            if on_file_tier(owner, name):
                held_in = owner._parameters if name in owner._parameters else owner._buffers
                aside.append((record, name, held_in, held_in[name]))
                held_in[name] = None  # `_apply` passes over a None
    try:
        yield
    finally:
        for record, name, held_in, placeholder in aside:
            source = record.tensors[name]
            dtype = applied_dtype(fn, source.dtype)
            if dtype != source.dtype:
                record.tensors[name] = source = dataclasses.replace(source, dtype=dtype)
                placeholder = source.placeholder(placeholder)
            held_in[name] = placeholder


def held(module: nn.Module, name: str) -> Tensor | None:
    """The tensor `name` of `module` as a fetch copies it: the one it holds, or, on the file tier, its bytes read
    from the file (`FileTier.read`)."""
    tensor = module._parameters[name] if name in module._parameters else getattr(module, name, None)
    if not isinstance(tensor, FileTensor):  # the parameter itself (a resident's `weight` attribute stands for it)
        return tensor
    record = module.__dict__.get(protocol.SOURCES)
    if record is None or name not in record.tensors:
        return tensor.values(None)  # not the tree's (a tensor assigned from another tree): read on its own
    return record.tier.read(module)[name]


def tensors_in_file(module: nn.Module) -> list[tuple[str, FileSource]]:
    """`module`'s tensors on the file tier, by name, with their sources."""
    return [(name, source) for name, source in sources(module).items() if on_file_tier(module, name)]
