"""ComfyUI nodes in ComfyUI's V3 schema: thin translations between ComfyUI's inputs and outputs and `runtime/`.

Each node's schema names its node id, the key saved workflows use: never rename one. A MODEL output is named `model`
with the id `model_out`: the older core refuses an output id that an input (the `model` it takes) already has.
ComfyUI loads the list through `comfy_entrypoint`, which the repository root re-exports inside ComfyUI.
"""

from comfy_api.latest import ComfyExtension, io

from .apply_policy import ApplyStreamwisePolicy
from .compile import QuantizedLazyTorchCompile
from .generate_speech import StreamwiseGenerateSpeech
from .generate_text import StreamwiseGenerateText
from .model_loader import StreamwiseModelLoader
from .policy_check import StreamwisePolicyCheck

NODES: list[type[io.ComfyNode]] = [
    StreamwiseModelLoader,
    ApplyStreamwisePolicy,
    QuantizedLazyTorchCompile,
    StreamwiseGenerateText,
    StreamwiseGenerateSpeech,
    StreamwisePolicyCheck,
]


class StreamwiseExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> StreamwiseExtension:
    return StreamwiseExtension()
