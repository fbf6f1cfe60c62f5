"""Compute kinds: how a streamed leaf computes once its weights are on the compute device.

Each kind named in `schemas.vocabulary.COMPUTE_KINDS` has one handler here, registered with `@compute_kind`
(a test checks every word has one). A handler receives the module, the input and the fetched `weight`/`bias`
and computes exactly what the original class computes from its own tensors, so a streamed forward is
bit-identical to the original one on the same device.

`dtype` says which dtype the weights are fetched in: `"input"` for ops that require the activation's dtype
(linear, convolutions), `"stored"` where the original computes with the weight's own dtype (embeddings, norms
that promote or upcast themselves).

The leaf-kind contract (`streamed.streaming_class` drives it; quantized residents implement it too):
`resident_forward(cls)` is the forward while the weights are resident, `split(module, input_name, args, kwargs)`
finds the activation the fetch follows, `fetch(fetcher, module, x)` brings the weights for one call,
`compute(module, x, fetched, *args, **kwargs)` computes with them and `release(...)` lets them go.

`generic` is the kind that needs no knowledge of the class: its direct parameters shadow the stored ones for the
call (in the instance dictionary, where attribute lookup finds them first) and the class's own forward runs, so it
is right by construction; it serves containers too. A specific kind is the fast path for the classes it was made
for; `fit(kind, cls)` says whether it provably reproduces a class (what `kind = "auto"` and the checks use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...schemas.vocabulary import AUTO_KIND
from ..registry import Registry
from . import protocol, widened
from .errors import EngineError

WeightDtype = Literal["input", "stored"]
#: What a specific kind's fetch brings; any other direct tensor of its module would stay behind.
FETCHED = ("weight", "bias")
Function = Callable[..., Tensor]
#: Small inputs for a class's own forward, shaped from the module's weight (None: nothing to probe on).
Probe = Callable[[nn.Module, torch.Generator], "list[Tensor] | None"]


@dataclass(frozen=True)
class ComputeKind:
    name: str
    function: Function
    dtype: WeightDtype
    requires: tuple[str, ...]
    made_for: tuple[type, ...] = ()
    """The classes whose forward the kind reproduces (a subclass that overrides none of `computes` is one too)."""
    computes: tuple[str, ...] = ("forward",)
    """The methods of a made-for class the computation stands for."""
    reference: Callable[..., Any] | None = None
    """A verbatim copy of a forward the kind reproduces: a class whose forward compiles to the same code is proven
    (transformers' many copies of LlamaRMSNorm)."""
    probe: Probe | None = None
    """Small inputs for the class's own forward, shaped from the module's weight, for the numerical check."""
    resident: Callable[..., Any] | None = None
    """The forward while resident, where the kind computes it itself (else the class's own)."""

    def missing(self, module: nn.Module) -> list[str]:
        """Attributes the handler needs that `module` lacks (checked before any conversion)."""
        return [name for name in self.requires if not protocol.has_attribute(module, name)]

    def resident_forward(self, cls: type[nn.Module]) -> Callable[..., Any]:
        return self.resident or cls.forward

    def split(self, module: nn.Module, input_name: str | None, args: tuple, kwargs: dict) -> tuple[Tensor, tuple]:
        """The input (first positional, or by its keyword) and the other positional arguments."""
        if args:
            return args[0], args[1:]
        if input_name in kwargs:
            return kwargs.pop(input_name), args
        raise EngineError(f"{_class_name(module)}.forward() got no input: pass it first"
                        + (f" or as `{input_name}=`" if input_name else ""))

    def fetch(self, fetcher: Any, module: nn.Module, x: Tensor) -> tuple:
        return fetcher.fetch(module, x.device, x.dtype if self.dtype == "input" else None)

    def compute(self, module: nn.Module, x: Tensor, fetched: tuple, *args, **kwargs) -> Tensor:
        weight, bias, _ = fetched
        return self.function(module, x, weight, bias, *args, **kwargs)

    def release(self, fetcher: Any, module: nn.Module, fetched: tuple) -> None:
        fetcher.release(module, *fetched)


class GenericKind(ComputeKind):
    """Any module with parameters, through its own forward: right by construction, for leaves and containers.

    Fetch: `weight` and `bias` the host's way (its weight functions, LoRA, applied), every other direct parameter
    as stored with what the host would merge into it by key (`fetch_parameters`); all in the stored dtype. A
    container also fetches its descendants' parameters that way (`protocol.claimed`): its forward may read them
    without calling the child (Mamba's mixer reads `conv1d.weight`). Compute: the fetched
    tensors shadow the stored ones in each owner's instance dictionary for the call (attribute lookup finds them
    before `nn.Module.__getattr__`), the original forward runs, and they are taken away again. Buffers are not
    fetched: a module that holds some also relocates them (`apply`).
    """

    def split(self, module: nn.Module, input_name: str | None, args: tuple, kwargs: dict) -> tuple[Tensor, tuple]:
        """The first tensor argument, for the device (without one, an empty tensor on the tree's compute device);
        every argument stays where it is."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                return value, args
        device = protocol.tree_of(module).compute_device
        if device is None:
            raise EngineError(f"{_class_name(module)}.forward() got no tensor argument and its tree has no compute "
                            "device yet, so the device to fetch its weights to is unknown; relocate it instead")
        return torch.empty(0, device=device), args

    def fetch(self, fetcher: Any, module: nn.Module, x: Tensor) -> tuple:
        parameters = module._parameters
        fetched: dict[str, Tensor] = {}
        through_host = None
        if parameters.get("weight") is not None:
            through_host = fetcher.fetch(module, x.device, None)
            fetched["weight"] = through_host[0]
            if parameters.get("bias") is not None:
                fetched["bias"] = through_host[1]
        raw = tuple(name for name, tensor in parameters.items() if tensor is not None and name not in fetched)
        if raw:
            fetched.update(zip(raw, fetcher.fetch_parameters(module, raw, x.device), strict=True))
        shadows = [(module, fetched)]
        for owner in protocol.claimed(module):
            names = tuple(name for name, tensor in owner._parameters.items() if tensor is not None)
            shadows.append((owner, dict(zip(names, fetcher.fetch_parameters(owner, names, x.device), strict=True))))
        return shadows, through_host

    def compute(self, module: nn.Module, x: Tensor, fetched: tuple, *args, **kwargs) -> Tensor:
        shadows, _ = fetched
        for owner, tensors in shadows:
            owner.__dict__.update(tensors)
        derived = _derived_again(module)
        try:
            return protocol.original_class(type(module)).forward(module, *args, **kwargs)
        finally:
            module.__dict__.update(derived)
            for owner, tensors in shadows:
                held = owner.__dict__
                for name in tensors:
                    del held[name]

    def release(self, fetcher: Any, module: nn.Module, fetched: tuple) -> None:
        _, through_host = fetched
        if through_host is not None:
            fetcher.release(module, *through_host)


def _class_name(module: nn.Module) -> str:
    """The name the module's author knows its class by (not the streaming class derived from it)."""
    return protocol.original_class(type(module)).__name__


def _derived_again(module: nn.Module) -> dict[str, object]:
    """Recompute, from the fetched parameters, what `weight_norm`'s forward pre-hook computed from the stored ones
    before the forward (the module's `weight`); returns what to put back afterwards."""
    if not module._forward_pre_hooks:
        return {}
    from torch.nn.utils.weight_norm import WeightNorm

    held, previous = module.__dict__, {}
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            previous[hook.name] = held.get(hook.name)
            held[hook.name] = hook.compute_weight(module)
    return previous


COMPUTE_KINDS: Registry[ComputeKind] = Registry("compute kind")
GENERIC = "generic"
COMPUTE_KINDS.register(GENERIC, GenericKind(GENERIC, None, "stored", ()))


def compute_kind(
    name: str, *, dtype: WeightDtype, requires: tuple[str, ...] = ("weight",), made_for: tuple[type, ...] = (),
    computes: tuple[str, ...] = ("forward",), reference: Callable[..., Any] | None = None, probe: Probe | None = None,
    resident: Callable[..., Any] | None = None,
):
    return COMPUTE_KINDS.decorator(name, lambda name, function: ComputeKind(
        name, function, dtype, requires, made_for, computes, reference, probe, resident))


_CONV = ("weight", "bias", "_conv_forward")
_CONV_T = ("weight", "bias", "stride", "padding", "groups", "dilation", "_output_padding", "kernel_size")
_EMBEDDING = ("weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


# Probe inputs: small, shaped from the module's weight, drawn from the caller's generator (never the global one), one
# per input rank a model feeds such a layer (a class may compute otherwise for one rank only).
_LEADING = ((), (2,), (2, 3), (2, 1, 3))  # unbatched, batched, a sequence, and one more leading dimension


def _like(module: nn.Module, generator: torch.Generator, *shape: int) -> Tensor:
    weight = module.weight
    return torch.randn(*shape, generator=generator, device=weight.device).to(weight.dtype)


def _trailing(module: nn.Module, generator: torch.Generator, *shape: int) -> list[Tensor]:
    """Inputs ending in `shape` (features, or a norm's normalized shape) with every leading rank."""
    return [_like(module, generator, *leading, *shape) for leading in _LEADING]


def _features(module: nn.Module, generator: torch.Generator) -> list[Tensor]:
    """What a Linear-shaped or 1-D-weight module takes: (..., in)."""
    return _trailing(module, generator, module.weight.shape[-1])


def _channels_first(module: nn.Module, generator: torch.Generator, spatial: int, channels: int | None = None, *,
                    unbatched: bool = True) -> list[Tensor]:
    """(1, channels, *spatial) and, where the class takes it, the unbatched (channels, *spatial)."""
    kernel = module.weight.shape[2:] or (1,)
    dilation = getattr(module, "dilation", 1)
    dilation = (dilation,) * len(kernel) if isinstance(dilation, int) else dilation
    reach = max((extent - 1) * step + 1 for extent, step in zip(kernel, dilation, strict=False))  # one output's view
    size = 4 * reach + 8
    channels = channels if channels is not None else module.weight.shape[0]
    batched = _like(module, generator, 1, channels, *(size,) * spatial)
    return [batched, batched[0]] if unbatched else [batched]


def _conv_probe(spatial: int) -> Probe:
    def probe(module: nn.Module, generator: torch.Generator) -> list[Tensor]:
        return _channels_first(module, generator, spatial, module.weight.shape[1] * getattr(module, "groups", 1))

    return probe


def _normalized(module: nn.Module, generator: torch.Generator) -> list[Tensor]:
    return _trailing(module, generator, *getattr(module, "normalized_shape", module.weight.shape))


def _resident_linear(module: nn.Module, input: Tensor) -> Tensor:  # `input`: nn.Linear.forward's, for calls by keyword
    return _linear(module, input, module.weight, module.bias)


@compute_kind("linear", dtype="input", requires=("weight", "bias"), made_for=(nn.Linear,), probe=_features,
              resident=_resident_linear)
def _linear(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if protocol.ARITHMETIC in module.__dict__:  # a half-precision weight a load filled (`widened.ARITHMETIC`)
        return widened.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _embedding_probe(module: nn.Module, generator: torch.Generator) -> list[Tensor]:
    return [torch.randint(0, module.weight.shape[0], (*leading, 3), generator=generator, device=module.weight.device)
            for leading in _LEADING[:3]]


@compute_kind("embedding", dtype="stored", requires=_EMBEDDING, made_for=(nn.Embedding,), probe=_embedding_probe)
def _embedding(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.embedding(
        x, weight, module.padding_idx, module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse
    )


_CONV_COMPUTES = ("forward", "_conv_forward")


@compute_kind("conv1d", dtype="input", requires=_CONV, made_for=(nn.Conv1d,), computes=_CONV_COMPUTES,
              probe=_conv_probe(1))
@compute_kind("conv2d", dtype="input", requires=_CONV, made_for=(nn.Conv2d,), computes=_CONV_COMPUTES,
              probe=_conv_probe(2))
@compute_kind("conv3d", dtype="input", requires=_CONV, made_for=(nn.Conv3d,), computes=_CONV_COMPUTES,
              probe=_conv_probe(3))
def _conv(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return module._conv_forward(x, weight, bias)


def _conv_transpose(functional: Callable[..., Tensor], spatial_dims: int) -> Function:
    def compute(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None, output_size=None) -> Tensor:
        if module.padding_mode != "zeros":
            raise EngineError(f"only `zeros` padding mode is supported for {_class_name(module)}")
        output_padding = module._output_padding(
            x, output_size, module.stride, module.padding, module.kernel_size, spatial_dims, module.dilation
        )
        return functional(
            x, weight, bias, module.stride, module.padding, output_padding, module.groups, module.dilation
        )

    return compute


for _name, _class, _functional, _dims in (("conv_transpose1d", nn.ConvTranspose1d, F.conv_transpose1d, 1),
                                          ("conv_transpose2d", nn.ConvTranspose2d, F.conv_transpose2d, 2)):
    compute_kind(_name, dtype="input", requires=_CONV_T, made_for=(_class,), computes=("forward", "_output_padding"),
                 probe=lambda module, generator, dims=_dims: _channels_first(module, generator, dims),
                 )(_conv_transpose(_functional, _dims))


@compute_kind("layer_norm", dtype="stored", requires=("weight", "bias", "normalized_shape", "eps"),
              made_for=(nn.LayerNorm,), probe=_normalized)
def _layer_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)


@compute_kind("group_norm", dtype="stored", requires=("weight", "bias", "num_groups", "eps"),
              made_for=(nn.GroupNorm,), probe=lambda module, generator: [
                  x for spatial in (0, 1, 2) for x in _channels_first(module, generator, spatial, unbatched=False)])
def _group_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return F.group_norm(x, module.num_groups, weight, bias, module.eps)


@compute_kind("rms_norm", dtype="stored", requires=("weight", "normalized_shape", "eps"), made_for=(nn.RMSNorm,),
              probe=_normalized)
def _rms_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return F.rms_norm(x, module.normalized_shape, weight, module.eps)


def _llama_rms(module: nn.Module, x: Tensor, weight: Tensor | None) -> Tensor:
    """fp32 statistics, cast back to the input dtype, then scale (transformers' LlamaRMSNorm)."""
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = hidden.to(input_dtype)
    return hidden if weight is None else weight * hidden


def _llama_rms_norm_forward(self, hidden_states):
    # transformers' LlamaRMSNorm.forward, verbatim: a class whose forward compiles to this code is proven
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _weighted_features(module: nn.Module, generator: torch.Generator) -> list[Tensor] | None:
    return _features(module, generator) if module._parameters.get("weight") is not None else None


@compute_kind("llama_rms_norm", dtype="stored", reference=_llama_rms_norm_forward, probe=_weighted_features)
def _llama_rms_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return _llama_rms(module, x, weight)


def _channels_first_norm(module: nn.Module, generator: torch.Generator) -> list[Tensor] | None:
    """(batch, channels, length): the only rank a conv norm's transposes take."""
    weighted = module._parameters.get("weight") is not None
    return _channels_first(module, generator, 1, unbatched=False) if weighted else None


@compute_kind("conv_rms_norm", dtype="stored", probe=_channels_first_norm)
def _conv_rms_norm(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    return _llama_rms(module, x.transpose(1, 2), weight).transpose(1, 2)


@compute_kind("conv_layer_norm", dtype="stored", requires=("weight", "bias", "normalized_shape", "eps"),
              probe=_channels_first_norm)
def _conv_layer_norm(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """VibeVoice's ConvLayerNorm: channels last, fp32 layer norm, back to the input dtype."""
    hidden = x.transpose(1, 2)
    hidden = F.layer_norm(hidden.float(), module.normalized_shape, weight.float(), bias.float(), module.eps)
    return hidden.type_as(x).transpose(1, 2)


class Fit(NamedTuple):
    """What a stream rule's kind makes of one class."""

    kind: str
    """The kind modules of the class compute with (`auto` chosen)."""
    proven: bool
    """Whether that kind provably reproduces the class (`generic` always does); if not, a probe checks it."""
    reason: str
    """Why, in a few words, for the plan."""
    refused: str | None = None
    """Why the kind must not compute for the class: it would give other numbers than the class's forward."""
    needs: frozenset[str] = frozenset()
    """What the kind reads that the class lacks: each module must hold it (as a parameter, usually)."""
    note: str | None = None
    """Why the kind named for the class was replaced by `generic` (a look-alike of the classes it is proven for)."""


def fit(kind_name: str, cls: type, *, named: bool = False) -> Fit:
    """How `kind_name` (a compute kind, or `auto`) fits modules of class `cls`; decided from the class alone.

    A specific kind computes a class it is proven for. For any other class it computes only when the rule `named`
    the class by its qualified name or the module by its exact path (a deliberate claim, which the probe then checks
    on real weights); otherwise
    the class is a look-alike of what the kind was made for (`Linear`, `LlamaRMSNorm` of another library) and
    computes with its own forward (`generic`), with a note saying so: a kind can never change the numbers.
    """
    original = protocol.original_class(cls)
    chosen = _fit(kind_name, original, named)
    return chosen._replace(needs=frozenset(
        name for name in COMPUTE_KINDS[chosen.kind].requires if not hasattr(original, name)))


def _fit(kind_name: str, original: type, named: bool) -> Fit:
    if kind_name == GENERIC:
        return Fit(GENERIC, True, "its own forward")
    if kind_name == AUTO_KIND:
        for kind in COMPUTE_KINDS.values():
            if kind.name != GENERIC and _proof(kind, original) is True:
                return Fit(kind.name, True, f"auto: `{kind.name}` reproduces `{original.__name__}`")
        return Fit(GENERIC, True, f"auto: no specific kind is proven for `{original.__name__}`; its own forward")
    proof = _proof(COMPUTE_KINDS[kind_name], original)
    if proof is True:
        return Fit(kind_name, True, f"`{kind_name}` reproduces `{original.__name__}`")
    if proof is None and named:
        return Fit(kind_name, False, f"`{kind_name}` is not proven for `{original.__name__}`: probed on real weights")
    if proof is None:
        qualified = f"{original.__module__}.{original.__qualname__}"
        return Fit(GENERIC, True, f"`{kind_name}` is not proven for `{original.__name__}`; its own forward",
                   note=f"`{qualified}` is not a class `{kind_name}` is proven for (a look-alike), so it computes "
                        f"with its own forward (`generic`) instead")
    return Fit(kind_name, False, proof, refused=proof)


def _proof(kind: ComputeKind, cls: type) -> bool | str | None:
    """True: `kind` reproduces `cls`; a string: it provably does not (why); None: nothing is known."""
    made_for = next((base for base in kind.made_for if issubclass(cls, base)), None)
    for klass in cls.__mro__:
        if klass in kind.made_for:
            return True  # reached the class the kind was made for, overriding nothing it computes
        overrides = [name for name in kind.computes if name in vars(klass)]
        if not overrides:
            continue
        if kind.reference is not None and overrides == ["forward"] and _same_code(vars(klass)["forward"],
                                                                                  kind.reference):
            return True
        if made_for is not None:
            return (f"`{cls.__name__}` overrides `{overrides[0]}` of `{made_for.__name__}`, so `{kind.name}` "
                    f"(which computes `{made_for.__name__}`) would not compute what the class does")
        return None
    return None


def _same_code(function: object, reference: Callable[..., Any]) -> bool:
    """Whether `function` compiles to exactly the reference's code (same operations, names and constants)."""
    code, expected = getattr(function, "__code__", None), reference.__code__
    return code is not None and (code.co_code, code.co_names, code.co_consts, code.co_argcount) == (
        expected.co_code, expected.co_names, expected.co_consts, expected.co_argcount)
