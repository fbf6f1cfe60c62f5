"""ComfyUI nodes: thin translations between ComfyUI's inputs and outputs and `runtime/`."""

from .apply_policy import ApplyStreamwisePolicy
from .generate_text import StreamwiseGenerateText
from .compile import INT8LazyTorchCompile
from .model_loader import StreamwiseModelLoader
from .policy_check import StreamwisePolicyCheck

NODE_CLASS_MAPPINGS = {
    "StreamwiseModelLoader": StreamwiseModelLoader,
    "ApplyStreamwisePolicy": ApplyStreamwisePolicy,
    "INT8LazyTorchCompile": INT8LazyTorchCompile,
    "StreamwiseGenerateText": StreamwiseGenerateText,
    "StreamwisePolicyCheck": StreamwisePolicyCheck,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "StreamwiseModelLoader": "Streamwise Model Loader",
    "ApplyStreamwisePolicy": "Apply Streamwise Policy",
    "INT8LazyTorchCompile": "Quantized Lazy Torch Compile",
    "StreamwiseGenerateText": "Streamwise Generate Text",
    "StreamwisePolicyCheck": "Streamwise Policy Check",
}
