"""ComfyUI nodes: thin translations between ComfyUI's inputs and outputs and `runtime/`."""

from .policy_check import StreamwisePolicyCheck

NODE_CLASS_MAPPINGS = {"StreamwisePolicyCheck": StreamwisePolicyCheck}
NODE_DISPLAY_NAME_MAPPINGS = {"StreamwisePolicyCheck": "Streamwise Policy Check"}
