"""Huge-page advice for large fresh CPU buffers: the kernel sees the advice, and compiled graphs stay whole.

Whether the kernel then gives huge pages depends on the machine's state (its free contiguous memory, khugepaged), so
the tests check the advice Streamwise gives, never the kernel's answer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from streamwise.runtime.quant import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping(address: int) -> dict[str, list[str]]:
    """The fields of the mapping in /proc/self/smaps that holds `address`."""
    inside, fields = False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, stop = (int(part, 16) for part in head.split("-"))
            inside = start <= address < stop
        elif inside:
            fields[head.removesuffix(":")] = line.split()[1:]
            if head == "VmFlags:":
                return fields
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages enabled",
)
def test_large_cpu_buffer_is_advised_before_first_touch():
    buffer = huge_pages.empty((4 * huge_pages.HUGE_PAGE,), torch.uint8, torch.device("cpu"))
    middle = buffer.data_ptr() + buffer.numel() // 2
    assert "hg" in mapping(middle)["VmFlags"]  # advised before the first touch, which is the kernel's to serve
    assert int(mapping(middle)["Rss"][0]) < 4 * huge_pages.HUGE_PAGE // 1024  # untouched yet: advised in time
    assert buffer.shape == (4 * huge_pages.HUGE_PAGE,) and buffer.dtype == torch.uint8


def test_compiled_graph_allocates_without_a_break():
    @torch.compile(fullgraph=True, backend="eager")
    def ones(n: int) -> torch.Tensor:
        return huge_pages.empty((n,), torch.float32, torch.device("cpu")).fill_(1)

    assert torch.equal(ones(huge_pages.HUGE_PAGE), torch.ones(huge_pages.HUGE_PAGE))
