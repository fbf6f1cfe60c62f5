// Streamwise's results on the nodes that made them, on every frontend the pack supports (1.27 to 1.49).
//
// A node's UI result is what its `execute` returns as `ui`: {"text": [...]} or {"audio": [...]}. The frontend draws
// such results only on nodes it knows, so this extension gives Streamwise's nodes the same displays: a read-only
// text box that shows the latest text, and core's own audio player (the `AUDIO_UI` widget it gives PreviewAudio),
// which the frontend fills from {"audio": [...]} itself. A cached node sends its result again, so both stay right.
import { app } from "../../scripts/app.js";

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

app.registerExtension({
  name: "Streamwise.Results",
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
