"""Budgets as users write them (bytes, sizes with units, a share of the device, "auto"), reported in human units."""

from __future__ import annotations

import logging

import pytest

import streamwise
from streamwise.runtime.hosts import standalone
from streamwise.runtime.sizes import SizeError, human, parse_size

from helpers import tiny_qwen2


@pytest.mark.parametrize("written, size", [
    ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), (" 512 mib ", 512 * 2**20), ("40KB", 40_000),
    ("0.5KiB", 512), ("1024", 1024), ("7B", 7), (3, 3), (2.0, 2), (0, 0),
])
def test_sizes_are_read_as_accelerate_reads_them(written, size):
    assert parse_size(written) == size


@pytest.mark.parametrize("written, message", [
    ("2 gigs", "write bytes with a unit"), ("-1GB", "write bytes with a unit"), ("", "write bytes with a unit"),
    ("0.5", "is whole"), (0.5, "written '50%'"), (-3, "not negative"), (float("nan"), "finite"),
    (True, "a number of bytes"), ([1], "a number of bytes"), ("9" * 100 + "GB", "write bytes with a unit"),
])
def test_nonsense_sizes_say_what_is_expected(written, message):
    with pytest.raises(SizeError, match=message):
        parse_size(written, "budget")


@pytest.mark.parametrize("size, shown", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**30 // 2, "1.5 GiB")])
def test_sizes_show_in_powers_of_1024(size, shown):
    assert human(size) == shown


def _offloaded(budget, monkeypatch, memory=(600_000, 1_000_000)):
    monkeypatch.setattr(standalone, "device_memory", lambda device: memory)
    return streamwise.offload(tiny_qwen2(), "decoder-llm", device="cpu", budget=budget)


def test_a_size_string_places_as_its_bytes_do(monkeypatch):
    written, counted = _offloaded("40KB", monkeypatch), _offloaded(40_000, monkeypatch)
    assert written == counted and written.budget == 40_000 and 0 < written.resident_bytes <= 40_000


def test_auto_is_the_free_memory_less_the_margin(monkeypatch):
    report = _offloaded("auto", monkeypatch)
    assert report.budget == 600_000 - int(1_000_000 * standalone.AUTO_MARGIN)


def test_auto_is_the_default_and_reads_this_machine():
    free, total = standalone.device_memory(standalone.torch.device("cpu"))
    assert 0 < free <= total
    report = streamwise.offload(tiny_qwen2(), "decoder-llm", device="cpu")
    assert report.budget is not None and report.streamed_modules == 0  # a tiny model fits any machine


def test_a_share_is_of_the_devices_total_memory(monkeypatch):
    assert _offloaded("5%", monkeypatch).budget == 50_000
    assert _offloaded("0%", monkeypatch).resident_bytes == 0


def test_the_report_and_the_log_say_the_budget_in_human_units(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="streamwise"):
        report = _offloaded("40KB", monkeypatch)
    text = str(report)
    assert text.startswith("budget 39.1 KiB on cpu: ") and human(report.streamed_bytes) in text
    assert [r.name for r in caplog.records] == ["streamwise.offload"] and text in caplog.records[0].getMessage()
