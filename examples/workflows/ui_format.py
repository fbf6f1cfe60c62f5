"""Write each API-format workflow here (what `POST /prompt` takes) also in the UI format (the graph ComfyUI's
frontend saves and loads by drag-and-drop) as `example_workflows/NAME.json` at the repository root, where core's
template browser lists a pack's workflows, from a running server's /object_info: widget values follow each node's
input order there, so the pair cannot drift from what the server declares.

    python examples/workflows/ui_format.py http://127.0.0.1:8188          # rewrite example_workflows/*.json
    python examples/workflows/ui_format.py http://127.0.0.1:8188 --check  # exit 1 where a file differs
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
UI_FOLDER = HERE.parent.parent / "example_workflows"  # the name core's template browser looks for
ORIGIN = (100, 160)  # the first node's corner: its title clear of the frontend's toolbars
GAP = 60  # between nodes of a column, with their titles
PREVIEW = 300  # an image upload's preview (LoadImage)
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEEDS = ("seed", "noise_seed")  # INT inputs after which the frontend keeps a control_after_generate value


def api_files(folder: Path = HERE) -> list[Path]:
    return sorted(folder.glob("*.json"))


def ui_path(api: Path) -> Path:
    return UI_FOLDER / api.name


def ordered_inputs(info: dict) -> list[tuple[str, list]]:
    """(name, spec) in the order the frontend makes slots and widgets: required, then optional."""
    order = info.get("input_order") or {section: list(specs) for section, specs in info["input"].items()}
    return [(name, info["input"][section][name]) for section in ("required", "optional")
            for name in order.get(section, [])]


def is_widget(spec: list) -> bool:
    options = spec[1] if len(spec) > 1 else {}
    return (isinstance(spec[0], list) or spec[0] in WIDGET_TYPES) and not options.get("forceInput")


def depths(api: dict) -> dict[str, int]:
    """Each node's distance from the graph's sources, for a left-to-right layout and the execution order."""
    memo: dict[str, int] = {}

    def depth(key: str) -> int:
        if key not in memo:
            sources = [v[0] for v in api[key]["inputs"].values() if isinstance(v, list)]
            memo[key] = 1 + max(map(depth, sources), default=-1)
        return memo[key]

    for key in api:
        depth(key)
    return memo


def to_ui(api: dict, object_info: dict) -> dict:
    """The UI-format graph of an API-format workflow (node ids are kept; links are numbered in input order)."""
    level = depths(api)
    keys = sorted(api, key=lambda k: (level[k], int(k)))
    nodes, links, outgoing = {}, [], {}
    bottoms: dict[int, int] = {}  # each column's next free height
    for order, key in enumerate(keys):
        node, info = api[key], object_info[api[key]["class_type"]]
        inputs, widgets = [], []
        for name, spec in ordered_inputs(info):
            value = node["inputs"].get(name, spec[1].get("default") if len(spec) > 1 else None)
            linked = isinstance(value, list)
            if is_widget(spec) and not linked:
                widgets.append(value)
                if spec[0] == "INT" and (name in SEEDS or spec[1].get("control_after_generate")):
                    widgets.append("fixed")
                continue
            slot = {"name": name, "type": "COMBO" if isinstance(spec[0], list) else spec[0], "link": None}
            if is_widget(spec):
                slot["widget"] = {"name": name}
            if linked:
                link = [len(links) + 1, int(value[0]), value[1], int(key), len(inputs), slot["type"]]
                links.append(link)
                slot["link"] = link[0]
                outgoing.setdefault((value[0], value[1]), []).append(link[0])
            inputs.append(slot)
        # room for each widget, for the result box the pack's frontend extension adds (web/streamwise.js), and for
        # an image upload's preview
        uploads = any(spec[1].get("image_upload") for _, spec in ordered_inputs(info) if len(spec) > 1)
        height = 200 + 28 * len(widgets) + PREVIEW * uploads
        top = bottoms.get(level[key], ORIGIN[1])
        bottoms[level[key]] = top + height + GAP
        nodes[key] = {
            "id": int(key), "type": node["class_type"], "pos": [ORIGIN[0] + 420 * level[key], top],
            "size": [380, height], "flags": {}, "order": order, "mode": 0,
            "inputs": inputs, "outputs": [], "properties": {"Node name for S&R": node["class_type"]},
            "widgets_values": widgets,
        }
        if "title" in node.get("_meta", {}):
            nodes[key]["title"] = node["_meta"]["title"]
    for key in keys:
        info = object_info[api[key]["class_type"]]
        names = info.get("output_name") or info["output"]
        nodes[key]["outputs"] = [
            {"name": name, "type": kind, "links": outgoing.get((key, slot), []), "slot_index": slot}
            for slot, (name, kind) in enumerate(zip(names, info["output"], strict=True))
        ]
    return {
        "last_node_id": max(map(int, api)), "last_link_id": len(links), "nodes": [nodes[k] for k in keys],
        "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}}, "version": 0.4,
    }


def render(graph: dict) -> str:
    return json.dumps(graph, indent=2) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    with urllib.request.urlopen(argv[0].rstrip("/") + "/object_info", timeout=60) as response:
        object_info = json.load(response)
    stale = []
    for path in api_files():
        text = render(to_ui(json.loads(path.read_text()), object_info))
        if "--check" in argv:
            if not ui_path(path).exists() or ui_path(path).read_text() != text:
                stale.append(ui_path(path).name)
        else:
            ui_path(path).write_text(text)
    for name in stale:
        print(f"{name} differs from what {argv[0]}'s /object_info makes of its API workflow", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
