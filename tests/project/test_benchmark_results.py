"""A benchmark's results file (`benchmarks/report.recorded`) never overwrites the figures of an earlier run."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_second_run_of_the_day_keeps_the_first_runs_figures(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import report

    runs = ("first run", "second run", "third run")
    for figures in runs:
        with report.recorded("bench_example", tmp_path):
            print(figures)
    written = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert len(written) == 3 and all(name.startswith("bench_example-") for name in written)
    assert all(sum(figures in text for text in written.values()) == 1 for figures in runs)
    first = min(written, key=len)  # `<name>-<date>.md`, then `-2.md`, `-3.md` after it
    assert "first run" in written[first]
