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


def queue_from_the_page(page, server, *, button: bool = False) -> dict:
    """Press the frontend's queue (as the Run button does; with `button`, the Run button itself) and wait for the
    prompt's /history entry. The prompt is found in /queue as soon as the server takes it: a first compiled run on a
    busy machine outlasts the minute given to the page to queue."""
    before = prompt_ids(server)
    if button:  # the toolbar's, in both frontends (1.49 also names its mode menu "Run": the first is the button)
        page.get_by_role("button", name="Run", exact=True).first.click()
    else:
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


def run_nodes(path: Path, info: dict) -> set[str]:
    """The nodes a prompt of the workflow at `path` runs (its API twin's output nodes and all they take inputs
    from): a CLIPTextEncode whose prompt is left for the user's sampler is not one."""
    graph = json.loads((harness.WORKFLOWS / path.name).read_text())
    left = [key for key, node in graph.items() if info[node["class_type"]]["output_node"]]
    found: set[str] = set()
    while left:
        key = left.pop()
        if key not in found:
            found.add(key)
            left += [value[0] for value in graph[key]["inputs"].values() if isinstance(value, list)]
    return found


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
                assert harness.cached_nodes(entry) == run_nodes(path, info)
            expect_results(page, entry, shows)
            page.wait_for_timeout(500)  # the player repaints its duration
            page.screenshot(path=str(screenshots / f"{path.stem}-{run}.png"))
    finally:
        page.close()


BOXES_JS = """() => Object.fromEntries(window.app.graph._nodes.filter(node => node.widgets?.some(
    w => w.name === "streamwise_result")).map(node => [String(node.id),
    node.widgets.find(w => w.name === "streamwise_result").element.value]))"""


def test_the_caption_workflow_run_by_the_run_button_shows_each_caption_on_its_node(server, browser, screenshots):
    """LoadImage -> Florence-2 -> CLIPTextEncode as shipped: the Run button, then the caption transformers makes of
    the image, drawn on Generate Text."""
    path = REPO / "example_workflows" / "streamwise_caption_image.json"
    page = opened(browser, server, json.loads(path.read_text()))
    try:
        entry = queue_from_the_page(page, server, button=True)
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
        api = json.loads((harness.WORKFLOWS / path.name).read_text())
        assert entry["outputs"]["3"]["text"] == [harness.caption_of(server, api, "3")]
        page.wait_for_function(f"() => ({BOXES_JS})()['3'].length > 0", timeout=30_000)
        assert page.evaluate(BOXES_JS)["3"] == entry["outputs"]["3"]["text"][0]
        page.screenshot(path=str(screenshots / "caption-run-button.png"))
    finally:
        page.close()


def test_a_failed_run_shows_its_error_on_the_node_and_no_earlier_result(server, browser, screenshots):
    """A run that fails at the loader: its box shows that error (not the report of the run before), and the boxes of
    the nodes after it are empty, not the text of the run before; the next good run fills them again."""
    path = REPO / "example_workflows" / "streamwise_generate_text.json"
    page = opened(browser, server, json.loads(path.read_text()))
    budget = """value => { const node = window.app.graph._nodes.find(n => n.type === "StreamwiseModelLoader");
        node.widgets.find(w => w.name === "host_budget").value = value; }"""
    try:
        assert queue_from_the_page(page, server, button=True)["status"]["status_str"] == "success"
        page.wait_for_function(f"() => Object.values(({BOXES_JS})()).every(text => text.length > 0)",
                               timeout=30_000)
        page.evaluate(budget, "4KiB")  # a host budget no model fits: the loader fails
        failed = queue_from_the_page(page, server, button=True)
        assert failed["status"]["status_str"] == "error"
        page.wait_for_function(f"() => ({BOXES_JS})()['1'].startsWith('error: HostBudgetError: ')", timeout=30_000)
        boxes = page.evaluate(BOXES_JS)
        assert "the host budget is 4.0 KiB" in boxes["1"] and "covered" not in boxes["1"]
        assert boxes["2"] == ""  # Generate Text did not run: nothing of the run before
        page.screenshot(path=str(screenshots / "failed-run.png"))
        page.keyboard.press("Escape")  # the error dialog the older frontend puts over the canvas
        page.evaluate(budget, "auto")
        assert queue_from_the_page(page, server, button=True)["status"]["status_str"] == "success"
        page.wait_for_function(f"() => Object.values(({BOXES_JS})()).every(text => text.length > 0)",
                               timeout=30_000)
        assert page.evaluate(BOXES_JS)["1"].startswith("`auto` picked")
    finally:
        page.close()
