"""ComfyUI nodes: thin translations between ComfyUI's inputs and outputs and `runtime/`.

Node ids are the keys saved workflows use: never rename one. Display names come from each node's `TITLE`.
"""

from .apply_policy import ApplyStreamwisePolicy
from .compile import QuantizedLazyTorchCompile
from .generate_text import StreamwiseGenerateText
from .model_loader import StreamwiseModelLoader
from .policy_check import StreamwisePolicyCheck

NODE_CLASS_MAPPINGS = {
    "StreamwiseModelLoader": StreamwiseModelLoader,
    "ApplyStreamwisePolicy": ApplyStreamwisePolicy,
    "INT8LazyTorchCompile": QuantizedLazyTorchCompile,
    "StreamwiseGenerateText": StreamwiseGenerateText,
    "StreamwisePolicyCheck": StreamwisePolicyCheck,
}
NODE_DISPLAY_NAME_MAPPINGS = {node_id: node.TITLE for node_id, node in NODE_CLASS_MAPPINGS.items()}
