"""The ComfyUI host's patcher: `model_patcher(model, ...)` hands a converted foreign tree to core's `ModelPatcher`,
`adopt(patcher, policy)` converts the tree of a MODEL another pack loaded, and `copied(patcher)` is a MODEL over a
copy of a tree, converted as it was, for a node to change (compile) while its input stays as it was.

Invariants:
- the patcher sees the model's own state-dict keys, so `add_patches` (LoRA) addresses them;
- a load tells the tree its compute device; an unload sends relocated tensors back;
- a streamed container (a `generic` module whose children hold parameters) always fetches: core places only
  modules whose parameters are all their own;
- a module with weights left in their file (a host budget at load) is never core's to place or patch: it is left
  out of core's load list, fetches through the file tier's reads, and gets core's LoRA patches as weight functions
  (as a module core streams does);
- a patch core would merge into a quantized resident's raw storage is kept beside its weight functions instead,
  applied for as long as core counts the weight patched (`engine.protocol.weight_functions`).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from ....schemas import Policy
from ...compile import lazy_compile
from ...convert import ConversionError, applied_state, apply, unconverted_copy
from ...engine import file_tier, protocol
from ...engine.classes import derived_class
from ...engine.journal import swap_class
from ...engine.relocating import offload_relocated
from ...engine.streamed import holds_parameters_below
from ...plan import plan_for
from ...plan.selectors import joined, walk_modules
from .fetcher import ComfyFetcher

#: What core's `clone` shares with a clone because both patch one tree (the unpatched weights, buffers and object
#: attributes it put back on unload, pinned weights, patched weights cached per hook group); a clone over a copied
#: tree keeps its own, else an unload of one would restore the other's tree, or empty its backups.
PER_TREE = ("backup", "backup_buffers", "object_patches_backup", "pinned", "hook_backup", "cached_hook_patches")
#: Core's load state on a model (as `ModelPatcher.__init__` starts it), which a copied tree starts afresh: it is loaded
#: nowhere yet, and core patches it anew.
LOAD_STATE = {"model_loaded_weight_memory": 0, "lowvram_patch_counter": 0, "model_lowvram": False,
              "current_weight_patches_uuid": None, "model_offload_buffer_memory": 0}
#: The copies made of each tree, held weakly on both sides (the tree itself is never marked), so that a tree coming
#: back from a device after its copies did shares its new host tensors with them (`_share_again`).
_COPIES: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]] = weakref.WeakKeyDictionary()


def model_patcher(
    model: nn.Module,
    *,
    load_device: torch.device,
    offload_device: torch.device,
    policy: Policy | str | None = None,
    allow_stranded: bool = False,
):
    """A ComfyUI `ModelPatcher` for a converted tree (converted here first when `policy` is given; `"auto"` picks
    the policy by `[match]`). A device named without an index is the current one of its kind (`"cuda"` is
    `cuda:0` where that is current), as core names its own: core unloads a model only from a device equal to its
    own, and `cuda` is not equal to `cuda:0`.

    A plan that strands tensors is refused (`Plan.refuse_stranded`), since core's first partial load on a GPU would
    crash on them, unless `allow_stranded`; the tree is then unchanged."""
    import comfy.model_patcher

    policy = _host(model, policy, allow_stranded)
    base = getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher)
    patcher = patcher_class(base)(model, load_device=_indexed(load_device), offload_device=_indexed(offload_device))
    return _armed(patcher, policy)


def _indexed(device: torch.device | str) -> torch.device:
    """`device` with the index of its kind's current device where it names none and the kind has one."""
    device = torch.device(device)
    backend = getattr(torch, device.type, None)
    if device.index is not None or not callable(getattr(backend, "is_available", None)) or not backend.is_available():
        return device
    index = backend.current_device()
    return torch.device(device.type, index) if isinstance(index, int) else device  # the CPU's has none


def adopt(patcher: Any, policy: Policy | str, allow_stranded: bool = False) -> Any:
    """A clone of a MODEL another node made, over a copy of its tree converted by `policy` and hosted here.

    The input MODEL, and every branch or workflow using it, stays exactly as it was (core's nodes never change an
    input): the clone holds an unconverted copy of the tree (`convert.copies`: new modules over the same weights, the
    weights as they are unpatched), and keeps everything ComfyUI's `clone` carries (LoRA patches, object patches,
    wrappers, callbacks, options); only its class gains this host's load and unload steps, which never write into a
    weight it shares. Stranding is refused as by `model_patcher`, before anything is made.
    """
    tree = _copied_tree(patcher)
    policy = _host(tree, policy, allow_stranded)
    return _armed(_clone_over(patcher, tree), policy)


def copied(patcher: Any) -> Any:
    """A clone of a MODEL over a copy of its tree converted as its tree is (by the same plan; a tree Streamwise never
    converted stays unconverted), for a node that changes the model it returns (compiling arms its blocks) while
    its input, like `adopt`'s, stays exactly as it was."""
    state = applied_state(patcher.model)
    tree = _copied_tree(patcher)
    if state is not None:
        if state.plan is not None:
            apply(state.plan, tree)
        _host(tree, None, allow_stranded=True)  # the input's conversion was accepted where it was made
    return _clone_over(patcher, tree)


def _copied_tree(patcher: Any) -> nn.Module:
    """An unconverted copy of a MODEL's tree (`convert.copies`), over its unpatched weights, remembering which
    tensors it shares with the input (`_share_again`)."""
    tree = unconverted_copy(patcher.model)
    shared = {joined(path, name): weakref.ref(tensor) for path, module in walk_modules(patcher.model)
              for name, tensor in module._parameters.items() if tensor is not None}
    for key, saved in getattr(patcher, "backup", {}).items():  # a weight core patched in place: its unpatched one
        owner, _, name = key.rpartition(".")
        module = tree.get_submodule(owner)
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(saved.weight.detach(), requires_grad=False)
            shared[key] = weakref.ref(saved.weight)
    tree.__dict__[protocol.SHARED] = shared
    _COPIES.setdefault(patcher.model, weakref.WeakSet()).add(tree)
    for name, value in LOAD_STATE.items():
        if name in tree.__dict__:
            tree.__dict__[name] = value
    return tree


def _clone_over(patcher: Any, tree: nn.Module) -> Any:
    """`patcher`'s clone over `tree`, with this host's load and unload steps."""
    clone = patcher.clone()
    clone.model, clone.size = tree, 0  # core sizes the copy anew (a policy may have quantized it)
    clone.weight_inplace_update = False  # core would merge a patch into a weight the copy shares
    for name in PER_TREE:
        if hasattr(clone, name):
            setattr(clone, name, type(getattr(clone, name))())
    clone.__class__ = patcher_class(protocol.original_class(type(patcher)))
    return clone


def _host(model: nn.Module, policy: Policy | str | None, allow_stranded: bool) -> Policy | None:
    """Convert `model` (when given a policy) and make its tree fetch through ComfyUI."""
    import comfy.model_management

    if policy is not None:
        policy, plan = plan_for(policy, model)
        if not allow_stranded:
            plan.refuse_stranded()  # before anything changes
        apply(plan, model)
    state = applied_state(model)
    if state is None:
        raise ConversionError("convert the model first (streamwise.apply) or pass policy=")
    if policy is None and not allow_stranded:
        state.plan.refuse_stranded()  # converted elsewhere (`apply`, `load`), by a plan that may strand
    walk = walk_modules(model)
    state.tree.fetcher = ComfyFetcher({id(module): path for path, module in walk})
    for _, module in walk:
        if _patched_at_fetch(module):  # never core's to place: a streamed container, a module reading its file
            protocol.set_fetching(module, True)
    if not isinstance(type(model).__dict__.get("device"), _SettableDevice):
        state.records.append(swap_class(model, _patchable_class(type(model)), {}, "host", root=True))
    archive = getattr(comfy.model_management, "archive_model_dtypes", None)
    if archive is not None:
        archive(model)  # pins each tensor's storage dtype where newer cores read it
    return policy


def _armed(patcher: Any, policy: Policy | None) -> Any:
    if policy is not None and policy.compile.enabled:
        return lazy_compile(patcher, policy)
    return patcher


class _SettableDevice:
    """ModelPatcher assigns `model.device`; transformers models make it a read-only property."""

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        if protocol.DEVICE in instance.__dict__:
            return instance.__dict__[protocol.DEVICE]
        return self.fallback.__get__(instance, owner) if hasattr(self.fallback, "__get__") else self.fallback

    def __set__(self, instance, value) -> None:
        instance.__dict__[protocol.DEVICE] = value


def _patchable_class(cls: type) -> type:
    """`cls` with a settable `device`, under its own name and module (transformers reads them)."""

    def namespace() -> dict[str, object]:
        return {"device": _SettableDevice(inspect.getattr_static(cls, "device", None)), "__module__": cls.__module__}

    return derived_class(_patchable_class, (cls,), cls.__name__, cls, namespace)


def patcher_class(base: type) -> type:
    """`base` (core's ModelPatcher or a pack's subclass of it) with this host's load and unload steps."""
    return derived_class(patcher_class, (base,), f"Streamwise{base.__name__}", base, dict, mixins=(_TreeKeeping,))


def _share_again(model: nn.Module) -> None:
    """After `model` came back from a device, host tensors it shares with another tree are shared again, whichever
    came back first: `model`'s weights take the host tensors of the tree it was copied from, and every copy of
    `model` already back takes `model`'s new ones. Core moves a weight back by making a new host tensor, so a copy
    loaded on a device beside its input would otherwise hold a second host copy of every weight they share."""
    _take_shared(model)
    for copy in list(_COPIES.get(model, ())):
        _take_shared(copy)


def _take_shared(copy: nn.Module) -> None:
    """Each weight of a copied tree whose values are those of the tensor it was copied over, on that tensor's device,
    shares it again (one still patched, or quantized by the copy's policy, keeps its own); a tree still on a device,
    or a shared tensor its tree let go of, is left alone."""
    shared = copy.__dict__.get(protocol.SHARED)
    if not shared:
        return
    for path, module in walk_modules(copy):
        for name, tensor in module._parameters.items():
            reference = shared.get(joined(path, name))
            home = reference() if reference is not None else None
            if (home is None or tensor is None or not (file_tier.in_memory(tensor) and file_tier.in_memory(home))
                    or tensor.device != home.device or tensor.data_ptr() == home.data_ptr()
                    or tensor.shape != home.shape or tensor.dtype != home.dtype or not torch.equal(tensor, home)):
                continue
            tensor.data = home.detach()


def _patched_at_fetch(module: nn.Module) -> bool:
    """Whether core leaves `module`'s patches to this host: a streamed container, or a module reading its weights
    from the file (neither is in core's load list), gets them as weight functions."""
    return protocol.kind_of(module) is not None and (holds_parameters_below(module) or file_tier.in_file(module))


class _TreeKeeping:
    """Keeps a Streamwise tree's compute device, relocated tensors and resident patches in step with core."""

    def load(self, device_to=None, *args, **kwargs):
        device = device_to if device_to is not None else self.load_device
        state = applied_state(self.model)  # None: a copy of a tree Streamwise never converted (`copied`)
        if state is not None:
            state.tree.compute_device = device
        loaded = super().load(device_to, *args, **kwargs)
        if state is not None:
            self._patch_what_core_skips(state.tree, device)
        return loaded

    def _patch_what_core_skips(self, tree, device) -> None:
        """Core patches only modules whose parameters are all their own, and none with weights in their file (left
        out of its load list). Generic containers, modules reading from the file, and what they claim get the
        patches as they fetch (`ComfyFetcher.fetch_parameters`; their own weight and bias through their weight
        functions), relocated parameters the way core patches a weight it loads whole: merged on the device, with
        a backup that `unpatch_model` puts back."""
        tree.fetcher.patches = self.patches
        from comfy.model_patcher import LowVramPatch

        for path, module in walk_modules(self.model):
            if _patched_at_fetch(module):
                for attribute, name in ((protocol.WEIGHT_FUNCTIONS, "weight"), (protocol.BIAS_FUNCTIONS, "bias")):
                    key = joined(path, name)
                    setattr(module, attribute, [LowVramPatch(key, self.patches)] if key in self.patches else [])
            for name in protocol.relocated_names(module):
                key = joined(path, name)
                if name in module._parameters and key in self.patches and key not in self.backup:
                    self.patch_weight_to_device(key, device_to=device)

    def _load_list(self, *args, **kwargs):
        """Core's list of modules to place, less those with weights in their file: core would load them whole
        (a copy read from the file, counted as loaded) or merge patches into them; they stay fetching, read from the
        file at each forward. Each entry ends with (name, module, parameter names) on every core."""
        return [entry for entry in super()._load_list(*args, **kwargs) if not file_tier.in_file(entry[-2])]

    def partially_unload(self, device_to, *args, **kwargs):
        freed = super().partially_unload(device_to, *args, **kwargs)
        _share_again(self.model)
        for module in self.model.modules():
            merged = module.__dict__.get(protocol.MERGED_PATCH)
            if merged is not None and not module.__dict__.get(protocol.PATCHED_FLAG, False):
                del module.__dict__[protocol.MERGED_PATCH]
                if not any(getattr(f, "key", None) == merged.key for f in module.weight_function):
                    module.weight_function = [*module.weight_function, merged]  # force-patched: keep it applied
        offload_relocated(self.model, device_to)
        return freed

    def unpatch_model(self, device_to=None, *args, **kwargs):
        unpatch_weights = kwargs.get("unpatch_weights", args[0] if args else True)
        result = super().unpatch_model(device_to, *args, **kwargs)
        state = applied_state(self.model)
        if unpatch_weights and state is not None:
            state.tree.fetcher.patches = None
            for module in self.model.modules():
                module.__dict__.pop(protocol.MERGED_PATCH, None)
                if _patched_at_fetch(module):
                    module.weight_function, module.bias_function = [], []
        if device_to is not None:
            offload_relocated(self.model, device_to)
            _share_again(self.model)
        return result

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, *args, **kwargs):
        module_path, _, name = key.rpartition(".")
        module = self.model.get_submodule(module_path)
        if name != "weight" or not protocol.is_resident(module):
            # never merged in place: the tensor may be shared with the MODEL this one was adopted from
            return super().patch_weight_to_device(key, device_to, False, *args, **kwargs)
        if key in self.patches:
            # Raw quantized storage cannot take a merged patch: the resident applies it on the fly for as long
            # as core counts the weight as patched.
            import comfy.model_patcher

            module.__dict__[protocol.MERGED_PATCH] = comfy.model_patcher.LowVramPatch(key, self.patches)
