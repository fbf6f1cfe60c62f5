"""Large weights read from the file tier by their rows, so that neither needs staging as large as itself: an embedding
gathers only the rows of its tokens (a 32k-token vocabulary at hidden size 1024 takes 125 MiB in float32, read a few
KiB at a time), and a linear layer computes its output features from a chunk of its weight's rows at a time (an LLM's
head, as large as its embedding, through staging of one chunk).

Both compute exactly what the whole weight computes. A gather copies rows. A linear layer's output features are
independent dot products over the same inputs, but a matrix kernel picks its blocking by the number of rows, and the
rows of a remainder block may sum in another order: chunks of a multiple of `ALIGN` rows, the last one taking the
remainder, give the CPU's kernels the blocks the whole weight gives them, bit for bit over vocabulary-sized and odd
shapes, float32, bfloat16 and float16, 1 to 300 positions (`tests/engine/test_row_reads.py`). Off the CPU the chunks
are assembled on the compute device and computed at once, by the kernel the whole weight takes. Only a floating
weight with nothing applied to it at a fetch (no weight function: a LoRA makes the whole weight) reads by rows; any
other reads whole, as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import protocol
from .file_reads import FileTier
from .file_tier import FileTensor, on_file_tier, sources

RowReads = Literal["gather", "chunks"]
#: How a leaf of each compute kind reads its weight by rows.
KINDS: dict[str, RowReads] = {"embedding": "gather", "linear": "chunks"}
CHUNK = 4 << 20
"""Bytes of staging a linear layer read in chunks needs at least (where no larger unit sizes the staging): two
chunks' worth, as the last chunk takes the remainder."""
ALIGN = 128
"""Rows a chunk holds a multiple of."""


def row_reads(kind: str | None, module: nn.Module) -> RowReads | None:
    """How a streamed leaf computing with `kind` reads its weight from the file tier: by the rows it gathers, by
    chunks of rows, or whole (None); an embedding that renormalizes its rows (`max_norm`) writes them, so it reads
    whole."""
    reads = KINDS.get(kind)
    if reads == "gather" and getattr(module, "max_norm", None) is not None:
        return None
    return reads


def staging_bytes(reads: RowReads | None, nbytes: int, row_bytes: int) -> int:
    """The staging a unit of `nbytes` in its file needs on the file tier: none for a gather (its rows are the size of
    its output, which the forward's own memory holds); for a linear layer whose weight's rows take `row_bytes`, two
    chunks of `ALIGN` rows, at least `CHUNK` (`_chunk_rows` reads it whole in less); else all of it."""
    if reads == "gather":
        return 0
    return min(nbytes, max(CHUNK, 2 * ALIGN * row_bytes)) if reads == "chunks" else nbytes


def reading_by_rows(module: nn.Module, kind: str | None) -> RowReads | None:
    """How `module` (a streamed leaf computing with `kind`) reads its weight now: by rows where it reads that way
    (`row_reads`) and its weight is on the file tier, a 2-D float tensor with nothing applied to it at a fetch, and,
    for chunks, larger than the tier's staging arenas (a smaller one is read whole, and ahead of its turn); else
    None (whole)."""
    reads = row_reads(kind, module)
    if reads is None or not on_file_tier(module, "weight") or protocol.weight_functions(module) \
            or protocol.bias_functions(module):
        return None
    source = sources(module)["weight"]
    plain = (source.range.dtype.is_floating_point and source.dtype.is_floating_point and len(source.shape) == 2
             and tuple(source.range.shape) == tuple(source.shape))
    if not plain or (reads == "chunks" and not _chunk_rows(source, module.__dict__[protocol.SOURCES].tier)):
        return None
    return reads


def _chunk_rows(source, tier: FileTier) -> int:
    """The rows of a chunk of `source`'s weight: a multiple of `ALIGN` of which two fit the tier's staging arena
    (the last chunk takes the remainder); 0 where the weight fits the arena whole (it is read whole, and ahead of its
    turn) or no two chunks do."""
    rows = source.shape[0]
    if source.range.nbytes <= tier.largest:
        return 0
    step = tier.largest // (source.range.nbytes // rows) // 2 // ALIGN * ALIGN
    return step if step and rows >= 2 * step else 0


@torch.compiler.disable  # a read from the file runs eagerly: a traced graph can hold neither a file nor the staging
def computed_by_rows(reads: RowReads, module: nn.Module, x: Tensor) -> Tensor:
    """What `module` computes from `x`, its weight read by rows as `reading_by_rows` says."""
    tier = module.__dict__[protocol.SOURCES].tier
    if reads == "gather":
        return _gathered(module, x, tier)
    return _chunked(module, x, tier)


def _gathered(module: nn.Module, x: Tensor, tier: FileTier) -> Tensor:
    """`F.embedding(x, weight)` from the rows `x` names alone: each distinct row read once, in file order."""
    source = sources(module)["weight"]
    if x.is_meta:  # a placement's trial run: no ids, so no rows to read
        return torch.empty((*x.shape, source.shape[1]), dtype=source.dtype, device=x.device)
    ids = x.detach().reshape(-1).to("cpu", torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= source.shape[0]):
        raise IndexError("index out of range in self")  # F.embedding's own words
    rows, index = torch.unique(ids, return_inverse=True)
    values = tier.read_rows(source, _runs(rows), pooled=False).to(x.device)
    return F.embedding(index.reshape(x.shape).to(x.device), values)


def _chunked(module: nn.Module, x: Tensor, tier: FileTier) -> Tensor:
    """`F.linear(x, weight, bias)` with the weight read a chunk of rows at a time: on the CPU each chunk's output
    features are computed as it arrives; elsewhere the chunks fill the weight on the compute device first."""
    source = sources(module)["weight"]
    bias = module.bias
    if isinstance(bias, FileTensor):
        bias = sources(module)["bias"].read()  # its own range: never the whole unit
    bias = None if bias is None else bias.to(x.device, x.dtype)
    spans = chunks(source.shape[0], _chunk_rows(source, tier))
    if x.device.type == "cpu":
        parts = []
        for (start, stop), rows in _read_in_turn(tier, module, source, spans):
            parts.append(F.linear(x, rows.to(x.dtype), None if bias is None else bias[start:stop]))
            del rows  # the staging starts over once nothing views it
        return torch.cat(parts, dim=-1)
    weight = torch.empty(source.shape, dtype=x.dtype, device=x.device)
    for (start, stop), rows in _read_in_turn(tier, module, source, spans):
        weight[start:stop].copy_(rows)
        del rows
    return F.linear(x, weight, bias)


def _read_in_turn(tier: FileTier, module: nn.Module, source,
                  spans: list[tuple[int, int]]) -> Iterator[tuple[tuple[int, int], Tensor]]:
    """Each span of `module`'s weight with its rows, in order, the spans after it read ahead (reader threads, into
    the staging left free) while it computes: the disk and the compute overlap, as for whole units. The first spans
    were read ahead while the unit before computed, where the tier learnt the order; once every span is started, the
    units after this one are, as staging frees. A span no staging was free for is read here. Each (span, rows) is a
    fresh pair, so the caller's `del` frees the rows' staging before the next top-up."""
    ahead: deque = deque(tier.rows_in_turn(module, source, spans))  # it lets go of the unit read whole before it
    started = len(ahead)
    for span in spans:
        while started < len(spans) and (pending := tier.read_rows_ahead(source, [spans[started]])) is not None:
            ahead.append(pending)
            started += 1
        if started == len(spans):  # as the staging of this unit's chunks frees, the next units are read into it
            tier.follow(module)
        if ahead:
            rows = ahead.popleft().taken()
        else:
            rows = tier.read_rows(source, [span])
            started += 1
        yield span, rows
        del rows


def chunks(rows: int, step: int) -> list[tuple[int, int]]:
    """[start, stop) chunks of `rows` rows, `step` each but the last, which takes the remainder (between `step` and
    twice it): every chunk starts at a multiple of `step`, as the whole weight's blocks do."""
    count = max(1, rows // step)
    return [(index * step, rows if index == count - 1 else (index + 1) * step) for index in range(count)]


def _runs(rows: Tensor) -> list[tuple[int, int]]:
    """The sorted distinct `rows` as [start, stop) runs of consecutive rows: one read each."""
    if rows.numel() == 0:
        return []
    breaks = torch.nonzero(rows[1:] - rows[:-1] != 1).flatten() + 1
    starts = torch.cat([rows[:1], rows[breaks]]).tolist()
    stops = torch.cat([rows[breaks - 1] + 1, rows[-1:] + 1]).tolist()
    return list(zip(starts, stops, strict=True))
