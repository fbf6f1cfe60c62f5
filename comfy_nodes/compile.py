"""Quantized Lazy Torch Compile: arm regional torch.compile on a MODEL (see runtime/compile/).

Its node id stays `INT8LazyTorchCompile`, the name saved workflows use. Input names are the policy's `[compile]`
keys (`dynamic_shape_tracing` is `dynamic`); their defaults and tooltips come from that table's schema, so the node
and a policy file cannot disagree. It shows what it armed and any warning; a compile that stops later is told on the
node that runs the model (`runtime/hosts/comfyui/compile.py`). Like every node, it never changes its input: it arms a
copy of the tree (`copied`), converted as the input is, over the same weights."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..runtime.compile.settings import runnable_backends
from ..runtime.hosts.comfyui import copied
from ..runtime.hosts.comfyui.compile import armed_with_report
from ..schemas.field_docs import field_descriptions
from ..schemas.policy import CompileSettings
from ..schemas.vocabulary import COMPILE_MODES
from .schema import schema

FIELDS = CompileSettings.model_fields
TOOLTIPS = field_descriptions(CompileSettings)


def _setting(kind: type[io.ComfyTypeIO], name: str, key: str | None = None, **options) -> io.Input:
    field = FIELDS[key or name]
    return kind.Input(name, default=field.default, tooltip=TOOLTIPS[key or name], **options)


class QuantizedLazyTorchCompile(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        backends = runnable_backends()
        return schema(
            category="model_patches", reports=True,
            aliases=("compile", "torch.compile", "quantize", "int8", "gguf", "inductor"),
            node_id="INT8LazyTorchCompile",
            display_name="Quantized Lazy Torch Compile",
            description="Compile a MODEL's repeated blocks lazily (on the first run), quantization- and "
                        "streaming-aware. The model is compiled where it runs next, not here.",
            inputs=[
                io.Model.Input("model", tooltip="A MODEL to compile: from the Streamwise loader, the Apply node, or "
                                                "any loader."),
                io.Combo.Input("backend", options=backends, tooltip=TOOLTIPS["backend"] + " Only the "
                               "backends that can run on this machine are offered.",
                               default="inductor" if "inductor" in backends else backends[0]),
                _setting(io.Boolean, "fullgraph"),
                _setting(io.Combo, "mode", options=list(COMPILE_MODES)),
                _setting(io.Boolean, "dynamic_shape_tracing", "dynamic"),
                io.Boolean.Input("compile_transformer_blocks_only", default=True,
                                 tooltip="Compile each repeated block (one graph reused by every layer); off "
                                         "compiles the whole model as one unit."),
                _setting(io.Int, "dynamo_cache_size_limit", min=1, max=65536),
                _setting(io.Boolean, "use_guard_filter"),
                _setting(io.Boolean, "disable_dynamic_vram"),
                _setting(io.Boolean, "verbose"),
            ],
            outputs=[io.Model.Output("model_out", display_name="model",
                                     tooltip="A copy of the model (the same weights), armed to compile; the input "
                                             "stays as it was.")],
        )

    @classmethod
    def execute(cls, model, compile_transformer_blocks_only: bool, **settings) -> io.NodeOutput:
        compiled, report = armed_with_report(
            copied(model), compile_transformer_blocks_only=compile_transformer_blocks_only, **settings)
        return io.NodeOutput(compiled, ui=ui.PreviewText(report))
