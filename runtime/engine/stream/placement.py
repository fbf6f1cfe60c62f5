"""Which streamed blocks stay resident within a device budget: the streamed ones spread along the forward's compute.

A streamed block's copy starts as the streamed block before it is entered (prefetch depth one; after the last block
of a forward comes the first of the next), so it hides behind the compute from that block's entry to its own: the
streamed block before it and every resident block between. All streamed at the end, the forward would be bound by
the link there while the device idles. So, walking the blocks in forward order, a block streams while the bytes
streamed so far lag the share of the forward's compute done by its end, and stays resident otherwise (where it fits):
each streamed block then has about its share of the compute before it, and the forward is at its floor wherever the
copies fit within the compute at all.

A block's compute is what one measuring forward timed (`measure.UnitClock`, by the block's name), or, unmeasured, its
bytes: the right stand-in where every block computes alike per byte (a decoder's layers), the wrong one where they do
not (a block of another quantization than its neighbours, an embedding that only gathers rows, a vision tower
computing over hundreds of patches before a language model's layers): there the measured placement puts the copies
where the compute is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def spread(names: Sequence[str], sizes: Sequence[int], budget: int,
           compute: Mapping[str, float] | None = None) -> list[bool]:
    """Which of the blocks (`names`, of `sizes` bytes, in forward order) stay resident within `budget` bytes, the
    streamed ones spread along their `compute` (seconds by name; their bytes where None). Blocks the spread leaves
    out though the budget has room for them are not added here: the caller fills what is left as it sees fit."""
    weights = list(sizes) if compute is None else [compute.get(name, 0.0) for name in names]
    total_weight = sum(weights)
    to_stream = max(0, sum(sizes) - budget)
    resident, used, streamed, done = [], 0, 0, 0.0
    for size, weight in zip(sizes, weights, strict=True):
        done += weight
        due = to_stream * done / total_weight if total_weight else to_stream
        keep = used + size <= budget and streamed + size / 2 >= due
        resident.append(keep)
        used, streamed = (used + size, streamed) if keep else (used, streamed + size)
    return resident
