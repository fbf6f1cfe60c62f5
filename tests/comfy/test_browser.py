"""The shipped workflows in the core's real frontend (its pinned `comfyui-frontend-package`), in headless Chromium:
each UI workflow is loaded as a user drops it in, queued from the page, and every result must be drawn on the node
that made it (the text, the report, an audio player holding the speech), then again when the nodes are cached.

Runs with $COMFYUI_ROOT (test_server.py's harness: the example models, main.py --cpu), Chromium (Debian's `chromium`,
or $STREAMWISE_CHROMIUM) and the Python package `playwright` (its driver only: no browser download). A screenshot of
each workflow, run and cached, is kept under $STREAMWISE_SCREENSHOTS (default: `build/screenshots/<core version>/` in
this checkout).
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO, module_from_file

harness = module_from_file(Path(__file__).with_name("test_server.py"))
server = harness.server  # main.py --cpu with the pack and the example models, stopped at the end
UI_WORKFLOWS = sorted((REPO / "example_workflows").glob("*.json"))
TEXT_NODES = {"StreamwiseModelLoader", "INT8LazyTorchCompile", "StreamwiseGenerateText", "StreamwisePolicyCheck",
              "ApplyStreamwisePolicy"}
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"]
# The frontend's own view of each node: its type, whether the frontend knows the type, and what each widget shows.
NODES_JS = """() => window.app.graph._nodes.map(node => ({
    id: String(node.id), type: node.type, known: node.type in window.LiteGraph.registered_node_types,
    widgets: Object.fromEntries((node.widgets || []).map(w => [w.name,
        w.element ? (w.element.tagName === "AUDIO" ? w.element.src : w.element.value) : w.value])),
}))"""


@pytest.fixture(scope="module")
def browser(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need `pip install playwright`")
    executable = os.environ.get("STREAMWISE_CHROMIUM") or shutil.which("chromium")
    if executable is None:
        pytest.skip("the browser tests need Chromium (Debian: apt install chromium) or $STREAMWISE_CHROMIUM")
    settings = server.log.parent / "user" / "default"
    settings.mkdir(parents=True, exist_ok=True)  # a returning user: no first-run template dialog over the canvas
    (settings / "comfy.settings.json").write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def screenshots(server) -> Path:
    version = server.request("/system_stats")["system"].get("comfyui_version", "core")
    folder = Path(os.environ.get("STREAMWISE_SCREENSHOTS", REPO / "build" / "screenshots")) / version
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def history(server) -> dict:
    with urllib.request.urlopen(server.url + "/history", timeout=30) as response:
        return json.load(response)


def prompt_ids(server) -> set[str]:
    """Every prompt the server knows, queued, running or done: /queue first, so a prompt that ends between the two
    requests is in /history."""
    queue = server.request("/queue")
    return {item[1] for item in queue["queue_running"] + queue["queue_pending"]} | set(history(server))


def queue_from_the_page(page, server) -> dict:
    """Press the frontend's queue (as the Run button does) and wait for the prompt's /history entry. The prompt is
    found in /queue as soon as the server takes it: a first compiled run on a busy machine outlasts the minute given
    to the page to queue."""
    before = prompt_ids(server)
    page.evaluate("() => window.app.queuePrompt(0)")
    page.wait_for_function("() => true")  # let the request leave
    for _ in range(600):
        new = sorted(prompt_ids(server) - before)
        if new:
            return server.wait(new[0], timeout=300)
        page.wait_for_timeout(100)
    raise AssertionError(f"the page queued nothing\n{server.tail()}")


RESULT_JS = """types => window.app.graph._nodes.filter(node => types.includes(node.type)).every(node => {
        const box = node.widgets.find(w => w.name === "streamwise_result" || w.name === "audioUI");
        return box.element.tagName === "AUDIO" ? box.element.readyState >= 1 && box.element.duration > 0
                                               : box.element.value.length > 0;
    })"""


def opened(browser, server, graph: dict):
    """A fresh page of the frontend with `graph` loaded, as a user drops the file in (nothing drawn on it yet)."""
    page = browser.new_page(viewport={"width": 1500, "height": 900})
    page.goto(server.url)
    page.wait_for_function("() => window.app && window.app.graph && window.LiteGraph", timeout=120_000)
    page.evaluate("graph => window.app.loadGraphData(graph)", graph)
    return page


def expect_results(page, entry: dict, types: set[str]) -> None:
    """Once the frontend has drawn the result of every node of `types`: each shows what this prompt made."""
    page.wait_for_function(RESULT_JS, arg=sorted(types), timeout=30_000)
    for node in page.evaluate(NODES_JS):
        widgets, output = node["widgets"], entry["outputs"].get(node["id"], {})
        if node["type"] not in types:
            continue
        if node["type"] == "StreamwiseGenerateSpeech":
            (audio,) = output["audio"]
            assert audio["filename"] in widgets["audioUI"]  # the player holds this prompt's speech
        elif node["type"] == "StreamwiseGenerateText":
            assert widgets["streamwise_result"] == "\n".join(output["text"])
        elif node["type"] == "StreamwiseModelLoader":  # not an output node: its report reaches the page only
            assert widgets["streamwise_result"].endswith("covered 100.00%")
            assert widgets["streamwise_result"].startswith(("`auto` picked", "policy `"))
        elif node["type"] == "INT8LazyTorchCompile":
            assert widgets["streamwise_result"].startswith("armed ")


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=lambda p: p.stem)
def test_a_shipped_workflow_shows_its_results_on_its_nodes_run_and_cached(server, browser, screenshots, path):
    """Run, queued again on the same page (everything cached), and queued again on a reopened page: output nodes
    show their results every time, report nodes too where the core resends them (v0.33's intermediate outputs)."""
    graph = json.loads(path.read_text())
    info = server.request("/object_info")
    types = {node["type"] for node in graph["nodes"]} & (TEXT_NODES | {"StreamwiseGenerateSpeech"})
    resent = {kind for kind in types if info[kind]["output_node"] or info[kind].get("has_intermediate_output")}
    page = opened(browser, server, graph)
    try:
        nodes = page.evaluate(NODES_JS)
        assert [(n["type"], n["known"]) for n in nodes] == [(n["type"], True) for n in graph["nodes"]]  # none missing
        for run, shows in (("run", types), ("cached", types), ("reopened", resent)):
            if run == "reopened":
                page.close()
                page = opened(browser, server, graph)
            entry = queue_from_the_page(page, server)
            assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
            if run != "run":  # queued again unchanged: nothing runs
                assert harness.cached_nodes(entry) == {str(node["id"]) for node in graph["nodes"]}
            expect_results(page, entry, shows)
            page.wait_for_timeout(500)  # the player repaints its duration
            page.screenshot(path=str(screenshots / f"{path.stem}-{run}.png"))
    finally:
        page.close()
