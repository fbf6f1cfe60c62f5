"""The runnable examples and the demo work as documented (small settings, CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

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


@pytest.mark.parametrize("script, arguments, message", [
    ("stream_llm.py", ["--budget", "2 gigs"], "budget='2 gigs': write bytes with a unit"),
    pytest.param("stream_llm.py", ["--device", "cuda"], "no usable cuda device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    ("compile_lazily.py", ["--policy", "no-such-policy"], "no policy named `no-such-policy`"),
    ("quantize_convrot.py", ["--policy", "no-such-policy"], "no policy named `no-such-policy`"),
])
def test_examples_take_a_policy_and_refuse_what_cannot_run_in_one_clear_line(script, arguments, message):
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *arguments], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_demo_compares_every_model_the_same_way_with_warm_timings():
    from streamwise.runtime.cli.demo import run_demo

    lines = []
    results = run_demo(print=lines.append)
    assert {k for k in results if k != "peak_rss_mib"} == {
        "qwen2/safetensors", "qwen2/gguf q8_0", "vibevoice-tokenizer/safetensors", "vibevoice-tokenizer/gguf q8_0",
    }
    for name, result in results.items():
        if name != "peak_rss_mib":
            assert {"max_error", "relative_error", "seconds", "eager_seconds"} <= result.keys(), name
    for name in ("qwen2/safetensors", "vibevoice-tokenizer/safetensors"):
        assert results[name]["identical"] and results[name]["max_error"] == results[name]["relative_error"] == 0
    assert results["qwen2/safetensors"]["tokens_agree"] == 16  # token agreement: LLMs only
    assert "tokens_agree" not in results["vibevoice-tokenizer/gguf q8_0"]
    assert results["vibevoice-tokenizer/gguf q8_0"]["relative_error"] < 0.02
    text = "\n".join(lines)
    assert "covered                       100.00%" in text and "residents {'gguf': 29}" in text
    assert text.count("(warm, median of 5)") == 2 and "budget " in text and " KiB" in text
    assert "rules:" not in text and "16/16 greedy tokens agree" in text


WORKFLOWS = sorted((REPO / "examples" / "workflows").glob("*.json"))


@pytest.mark.parametrize("api", WORKFLOWS, ids=lambda p: p.stem)
def test_each_workflow_ships_in_the_ui_format_with_the_same_graph(api):
    """Without ComfyUI: the same nodes, links and widget values (the API files list inputs in each node's order).
    tests/comfy/test_server.py checks the whole file against what a server's /object_info makes of it."""
    import json

    graph, ui = json.loads(api.read_text()), json.loads((REPO / "example_workflows" / api.name).read_text())
    nodes = {str(node["id"]): node for node in ui["nodes"]}
    assert {k: node["type"] for k, node in nodes.items()} == {k: node["class_type"] for k, node in graph.items()}
    linked = sorted((str(src), out, str(to), nodes[str(to)]["inputs"][slot]["name"])
                    for _, src, out, to, slot, _ in ui["links"])
    assert linked == sorted((value[0], value[1], key, name) for key, node in graph.items()
                            for name, value in node["inputs"].items() if isinstance(value, list))
    for key, node in graph.items():
        widgets = []
        for name, value in node["inputs"].items():
            if not isinstance(value, list):
                widgets += [value, "fixed"] if name == "seed" else [value]  # the frontend's control_after_generate
        assert nodes[key]["widgets_values"] == widgets
