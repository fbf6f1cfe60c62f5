"""The low-VRAM protocol every converted leaf speaks: ComfyUI's own attribute names, on purpose.

ComfyUI core's `ModelPatcher` streams a module when it finds three attributes on it: the flag `comfy_cast_weights`
(set while the weights live off the compute device) and the lists `weight_function` and `bias_function` (LoRA
patches applied to a fetched weight). Streamwise leaves carry exactly these, so core drives them with no adapter; the
standalone host sets the same flag. As on core's own layers, the class holds the resting values (`LEAF_DEFAULTS`)
and a host sets the instance's own when it streams or patches the leaf. This module is the one place outside the
ComfyUI host that spells those names, and the one place that spells Streamwise's own `_sw_*` markers.

Invariants:
- a leaf fetches its weights per forward exactly when `is_fetching` is true; otherwise its forward computes from
  the tensors it holds (the original forward, for float leaves; a load's half-precision Linear leaves may widen on
  the CPU, `widened`);
- every converted module's class derives from its original class, named by `original_class`;
- every converted module of one tree points at one `StreamTree` (`tree_of`), never at process-global state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

FETCH_FLAG = "comfy_cast_weights"
WEIGHT_FUNCTIONS = "weight_function"
BIAS_FUNCTIONS = "bias_function"
#: Set by core on a module whose weights it counts as patched (a merged LoRA).
PATCHED_FLAG = "comfy_patched_weights"
#: Where a host keeps a patch it would have merged into a weight, were the storage float (quantized residents).
MERGED_PATCH = "_sw_merged_patch"
#: Where newer cores' dynamic-VRAM loading puts a weight's (a bias's) LoRA patch, applied before the functions.
WEIGHT_LOWVRAM_FUNCTION = "weight_lowvram_function"
BIAS_LOWVRAM_FUNCTION = "bias_lowvram_function"

ORIGINAL_CLASS = "_sw_original_class"  # on derived classes: the class they were derived from
KIND = "_sw_kind"  # on streamed classes: the name of the compute kind
HANDLER = "_sw_handler"  # on resident classes: the quant format handler
TREE = "_sw_tree"  # on converted instances: the tree's StreamTree
RELOCATED = "_sw_relocated"  # on relocating instances: the names of the tensors that follow the compute device
CLAIMED = "_sw_claimed"  # on generic containers: the descendants whose parameters it fetches with its own
SOURCES = "_sw_sources"  # on modules loaded from a file: where each tensor can be read back from (`file_tier`)
NAME = "_sw_name"  # on residents: the module's path in the model it was made in, for messages
COMPUTE_DTYPE = "_sw_compute_dtype"  # on residents: the dtype of the float weight their storage quantizes
GROUP_SIZE = "_sw_group_size"  # on INT8/INT4 residents: the quantization group size (None: one scale per row)
ARITHMETIC = "_sw_arithmetic"  # on residents and half-precision Linear leaves a load made: how they compute on the CPU
STATE = "_streamwise"  # on a converted root: its `AppliedState` (the tree, the records that undo it, the plan)
COMPILE_STATE = "_sw_compile"  # on a module or host model armed for compilation: its `Armed` state
DEVICE = "_sw_device"  # on a hosted root: the device a host assigned to `model.device` (read-only in transformers)
REGION = "_sw_region"  # on compiled regions: a marker, not a class (ComfyUI may import this pack under two names)
VIEWS = "_sw_views"  # on a unit's modules while their block's compiled graph runs: their tensors' slot views
SHARED = "_sw_shared"  # on a copied root: weak references to the tensors its weights share with the tree copied

#: A streamed leaf's class attributes: resident, unpatched. Immutable, so a stray in-place append fails instead of
#: patching every leaf of the class (core assigns an instance list before it extends one).
LEAF_DEFAULTS: dict[str, object] = {FETCH_FLAG: False, WEIGHT_FUNCTIONS: (), BIAS_FUNCTIONS: ()}


def leaf_forward(resident: Callable[..., Any], streamed: Callable[..., Any]) -> Callable[..., Any]:
    """The forward of every streamed leaf: `streamed(self, args, kwargs)` while fetching, else `resident`.

    The hot path of the whole engine: three attribute reads (the instance's, else the class's) and one branch before
    the original forward (`benchmarks/bench_fast_path.py` holds it within 3% of an unconverted model).
    """

    def forward(self, *args, **kwargs):
        if self.comfy_cast_weights or self.weight_function or self.bias_function:
            return streamed(self, args, kwargs)
        return resident(self, *args, **kwargs)

    return forward


def leaf_attributes(module: nn.Module, tree: object) -> dict[str, object]:
    """The instance attributes a streamed leaf starts with: in `tree`, and resident and unpatched (the class says
    so, `LEAF_DEFAULTS`, unless the instance holds values of its own). An undo of the conversion also clears
    `LEAF_DEFAULTS`' names, which a host sets on the instance meanwhile."""
    attributes: dict[str, object] = {TREE: tree}
    if not module.__dict__.keys().isdisjoint(LEAF_DEFAULTS):  # reset, as core's `wipe_lowvram_weight` does
        attributes.update({FETCH_FLAG: False, WEIGHT_FUNCTIONS: [], BIAS_FUNCTIONS: []})
    held = module._parameters  # where they usually are: no call per name
    if "bias" not in held and not has_attribute(module, "bias"):  # core reads `weight` and `bias` of every module
        attributes["bias"] = None  # carrying the flag
    if "weight" not in held and not has_attribute(module, "weight"):  # a generic module holding other parameters
        attributes["weight"] = None  # only (MoE experts)
    return attributes


def has_attribute(module: nn.Module, name: str) -> bool:
    """`hasattr(module, name)` without a raised AttributeError per miss (conversion asks it for every leaf)."""
    return (name in module._parameters or name in module.__dict__ or name in module._buffers
            or name in module._modules or hasattr(type(module), name))


def is_fetching(module: nn.Module) -> bool:
    return bool(module.comfy_cast_weights or module.weight_function or module.bias_function)


def set_fetching(module: nn.Module, fetching: bool) -> None:
    """Whether the leaf's weights live off the compute device (the standalone host's placement switch)."""
    module.comfy_cast_weights = fetching


def weight_functions(module: nn.Module) -> list:
    """The functions to apply to a fetched weight: its patch (one the host kept aside while core counts the weight as
    patched, since raw storage cannot take a merged one; else one core's dynamic-VRAM loading set), then the weight
    functions."""
    merged = module.__dict__.get(MERGED_PATCH)
    if merged is not None and module.__dict__.get(PATCHED_FLAG, False):
        return [merged, *module.weight_function]
    return _with_lowvram_patch(module, WEIGHT_LOWVRAM_FUNCTION, module.weight_function)


def bias_functions(module: nn.Module) -> list:
    return _with_lowvram_patch(module, BIAS_LOWVRAM_FUNCTION, module.bias_function)


def _with_lowvram_patch(module: nn.Module, attribute: str, functions: list) -> list:
    """`functions` after the dynamic-VRAM patch, which applies, as in core, only while the module is cast per use
    (core sets it at a load and never clears it)."""
    patch = module.__dict__.get(attribute)
    return functions if patch is None or not module.__dict__.get(FETCH_FLAG, False) else [patch, *functions]


def stored_dtype_attributes(tensors: dict[str, Any]) -> dict[str, object]:
    """Attributes telling newer cores each tensor travels in its stored dtype (they cast any other weight)."""
    return {f"{name}_comfy_model_dtype": tensor.dtype for name, tensor in tensors.items()}


def original_class(cls: type) -> type:
    """The class a derived class was made from (`cls` itself when it is not one)."""
    return getattr(cls, ORIGINAL_CLASS, cls)


def speaks_natively(cls: type) -> bool:
    """Whether `cls` streams in ComfyUI on its own (core's `comfy.ops` layers define the flag on the class): such a
    module is left as it is, and its weight and bias count as streamed."""
    return getattr(cls, ORIGINAL_CLASS, None) is None and any(FETCH_FLAG in vars(klass) for klass in cls.__mro__)


def kind_of(module: nn.Module) -> str | None:
    """The compute kind a streamed leaf computes with, or None for any other module."""
    return getattr(type(module), KIND, None)


def quant_handler(module: nn.Module) -> Any:
    """The quant format handler of a quantized resident, or None for any other module."""
    return getattr(type(module), HANDLER, None)


def is_resident(module: nn.Module) -> bool:
    return quant_handler(module) is not None


def tree_of(module: nn.Module) -> Any:
    return module.__dict__.get(TREE)


def relocated_names(module: nn.Module) -> tuple[str, ...]:
    return module.__dict__.get(RELOCATED, ())


def claimed(module: nn.Module) -> tuple[nn.Module, ...]:
    """The descendants whose parameters a generic container fetches with its own."""
    return module.__dict__.get(CLAIMED, ())
