// Streamwise's results on the nodes that made them, on every frontend the pack supports (1.27 to 1.49).
//
// A node's UI result is what its `execute` returns as `ui`: {"text": [...]} or {"audio": [...]}. The frontend draws
// such results only on nodes it knows, so this extension gives Streamwise's nodes the same displays: a read-only
// text box that shows the latest text, and core's own audio player (the `AUDIO_UI` widget it gives PreviewAudio),
// which the frontend fills from {"audio": [...]} itself. A cached node sends its result again, so both stay right.
// Each run empties the boxes of the nodes it runs anew (all but those it takes from the cache, whose result stands;
// older cores resend only output nodes' results), and a node that fails shows its error instead: a box never shows
// what an earlier run made beside this run's error.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const TEXT_NODES = new Set([
  "StreamwiseModelLoader", "ApplyStreamwisePolicy", "INT8LazyTorchCompile", "StreamwiseGenerateText",
  "StreamwisePolicyCheck",
]);
const AUDIO_NODES = new Set(["StreamwiseGenerateSpeech"]);
const RESULT = "streamwise_result";

function addResultBox(node) {
  const box = document.createElement("textarea");
  box.readOnly = true;
  box.className = "comfy-multiline-input streamwise-result";
  box.placeholder = "(the result appears here)";
  box.style.cssText = "width:100%;height:100%;box-sizing:border-box;resize:none;font-family:monospace;font-size:11px";
  const widget = node.addDOMWidget(RESULT, "streamwise_result", box, { serialize: false, getValue: () => box.value,
    setValue: (value) => { box.value = value ?? ""; } });
  widget.serialize = false;
  return widget;
}

function showText(node, text) {
  const widget = node.widgets?.find((w) => w.name === RESULT);
  if (widget && text?.length) {
    widget.element.value = text.join("\n");
    widget.element.title = widget.element.value;
  }
}

function clearResults({ detail }) {
  const cached = new Set((detail?.nodes ?? []).map(String));
  for (const node of app.graph?._nodes ?? []) {
    const rerun = TEXT_NODES.has(node.type) && !cached.has(String(node.id));
    const widget = rerun && node.widgets?.find((w) => w.name === RESULT);
    if (widget) {
      widget.element.value = "";
      widget.element.title = "";
    }
  }
}

function showError({ detail }) {
  const node = app.graph?.getNodeById?.(detail?.node_id);
  if (node && TEXT_NODES.has(node.type)) {
    const kind = String(detail.exception_type ?? "").split(".").pop();  // the class, not its module path
    showText(node, [`error: ${kind}: ${detail.exception_message ?? ""}`]);
  }
}

app.registerExtension({
  name: "Streamwise.Results",
  setup() {
    api.addEventListener("execution_cached", clearResults);  // sent once per run, before any node runs
    api.addEventListener("execution_error", showError);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (AUDIO_NODES.has(nodeData.name)) {
      nodeData.input.required.audioUI = ["AUDIO_UI", {}];  // core's player, as on PreviewAudio
    }
    if (!TEXT_NODES.has(nodeData.name)) {
      return;
    }
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      created?.apply(this, arguments);
      addResultBox(this);
    };
    const executed = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      executed?.apply(this, arguments);
      showText(this, message?.text);
    };
  },
});
