"""The runnable examples and the demo work as documented (small settings, CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.parametrize("script, expected", [
    ("stream_llm.py", "generated token ids"),
    ("quantize_convrot.py", "reloaded identical: True"),
    ("compile_lazily.py", "6 decoder layers share 1 compiled region(s): 1 graph(s), 0 graph breaks"),
])
def test_example_runs(script, expected):
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / script)], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout


def test_demo_reports_parity_for_both_models_and_formats():
    from streamwise.runtime.cli.demo import run_demo

    lines = []
    results = run_demo(print=lines.append)
    assert {k for k in results if k != "peak_rss_mib"} == {
        "qwen2/safetensors", "qwen2/gguf q8_0", "vibevoice-tokenizer/safetensors", "vibevoice-tokenizer/gguf q8_0",
    }
    assert results["qwen2/safetensors"]["identical"] and results["vibevoice-tokenizer/safetensors"]["identical"]
    assert results["vibevoice-tokenizer/gguf q8_0"]["relative_error"] < 0.02
    text = "\n".join(lines)
    assert "coverage 100%" in text and "residents {'gguf': 29}" in text
