"""Compile through a real ComfyUI server (the harness of test_server.py): decoding makes a fixed number of graphs,
the node's cache limit holds in the prompt's worker, and a stop is told on the node that runs the model.

With STREAMWISE_BENCH_OUT set, the figures go to that JSON file (benchmarks/bench_compile_server.py sets it)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("server_harness", Path(__file__).with_name("test_server.py"))
server_harness = importlib.util.module_from_spec(_spec)  # a sibling test module is not importable by name here
_spec.loader.exec_module(server_harness)
server = server_harness.server  # its fixture: a server of this module's own
expected_text, workflow = server_harness.expected_text, server_harness.workflow
FIGURES: dict = {}


def compile_workflow(tokens: int, **settings) -> dict:
    graph = workflow("streamwise_compile")
    graph["2"]["inputs"].update(verbose=True, **settings)
    graph["3"]["inputs"]["max_new_tokens"] = tokens
    return graph


def graphs_logged(log: str) -> int:
    """Graphs the compile node's regions made, from their verbose lines ("N new graph(s) in S s")."""
    return sum(int(count) for count in re.findall(r"(\d+) new graph\(s\) in", log))


def record(**figures) -> None:
    FIGURES.update(figures)
    if os.environ.get("STREAMWISE_BENCH_OUT"):
        Path(os.environ["STREAMWISE_BENCH_OUT"]).write_text(json.dumps(FIGURES))


def test_the_first_compiled_prompt_decodes_32_tokens_with_a_fixed_number_of_graphs(server):
    start = time.monotonic()
    graph = compile_workflow(32)
    entry = server.run(graph)  # the server's first prompt: it loads, arms and compiles
    seconds = time.monotonic() - start
    assert entry["outputs"]["3"]["text"] == [expected_text(server.model, graph, "3")]
    assert entry["outputs"]["2"]["text"][0].startswith("armed 2 block(s) in 1 region(s)")
    graphs = graphs_logged(server.log.read_text())
    record(first_prompt_s=round(seconds, 2), graphs_32_tokens=graphs)
    assert 0 < graphs <= 3 * 2  # per layer: the prompt, the first step, the step making the KV length dynamic


def test_the_nodes_limit_holds_in_the_prompts_worker_and_a_stop_is_told_on_the_running_node(server):
    import aiohttp

    async def run_listening() -> tuple[dict, list[tuple[str, str]]]:
        texts = []
        async with aiohttp.ClientSession() as session, session.ws_connect(
                f"{server.url}/ws?clientId=streamwise-tests") as socket:
            running = asyncio.ensure_future(asyncio.to_thread(server.run, graph))
            while not running.done():
                try:
                    message = await socket.receive(timeout=0.2)
                except asyncio.TimeoutError:
                    continue
                if message.type == aiohttp.WSMsgType.BINARY and int.from_bytes(message.data[:4], "big") == 3:
                    length = int.from_bytes(message.data[4:8], "big")  # progress text: node id, then the text
                    texts.append((message.data[8:8 + length].decode(), message.data[8 + length:].decode()))
            return running.result(), texts

    graph = compile_workflow(8, dynamo_cache_size_limit=1)
    entry, texts = asyncio.run(run_listening())
    assert entry["outputs"]["3"]["text"] == [expected_text(server.model, graph, "3")]  # eager past the limit
    stops = [(node, text) for node, text in texts if "stopped compiling" in text]
    assert stops and all(node == "3" for node, _ in stops)  # Generate Text runs the model, so it is told
    assert "hit the recompile limit (1 graphs)" in stops[0][1]  # the node's limit, not torch's default 8
    assert "stopped compiling" in server.log.read_text()  # and the log, which the frontend's log panel shows
