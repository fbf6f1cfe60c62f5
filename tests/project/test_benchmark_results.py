"""A benchmark's results file (`benchmarks/report.recorded`) never overwrites the figures of an earlier run."""

from __future__ import annotations

import datetime
import types
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class _Noon(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 12, 7, 12, tzinfo=tz)


def test_a_second_run_of_the_day_keeps_the_first_runs_figures(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import report

    monkeypatch.setattr(report, "datetime", types.SimpleNamespace(datetime=_Noon, UTC=datetime.UTC))
    for figures in ("first run", "second run", "third run"):
        with report.recorded("bench_example", tmp_path):
            print(figures)
    for name, figures in (("", "first run"), ("-2", "second run"), ("-3", "third run")):
        assert figures in (tmp_path / f"bench_example-2026-12-07{name}.md").read_text()
    assert len(list(tmp_path.iterdir())) == 3
