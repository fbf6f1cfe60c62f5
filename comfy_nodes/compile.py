"""Quantized Lazy Torch Compile: arm regional torch.compile on a MODEL (see runtime/compile/).

Its node id stays `INT8LazyTorchCompile`, the name saved workflows use."""

from __future__ import annotations

from ..runtime.compile import lazy_compile
from ..runtime.compile.settings import runnable_backends
from ..schemas.vocabulary import COMPILE_MODES


class QuantizedLazyTorchCompile:
    TITLE = "Quantized Lazy Torch Compile"
    CATEGORY = "streamwise"
    DESCRIPTION = "Compile a MODEL's repeated blocks lazily (on the first run), quantization- and streaming-aware."
    FUNCTION = "compile"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)

    @classmethod
    def INPUT_TYPES(cls):
        backends = runnable_backends()
        return {"required": {
            "model": ("MODEL",),
            "backend": (backends, {"default": "inductor" if "inductor" in backends else backends[0]}),
            "fullgraph": ("BOOLEAN", {"default": False}),
            "mode": (list(COMPILE_MODES), {"default": "default"}),
            "dynamic_shape_tracing": ("BOOLEAN", {"default": False}),
            "compile_transformer_blocks_only": ("BOOLEAN", {"default": True}),
            "dynamo_cache_size_limit": ("INT", {"default": 64, "min": 1, "max": 65536}),
            "use_guard_filter": ("BOOLEAN", {"default": True}),
            "disable_dynamic_vram": ("BOOLEAN", {"default": False}),
            "verbose": ("BOOLEAN", {"default": False}),
        }}

    def compile(self, model, compile_transformer_blocks_only, **settings):
        return (
            lazy_compile(model.clone(), compile_transformer_blocks_only=compile_transformer_blocks_only, **settings),
        )
