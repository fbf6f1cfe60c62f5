"""Look-alike classes: the short name of a class a shipped policy selects, with other math.

Each is what a model author might write (or another library ships) under a familiar name: a `Linear` that adds a
term for 3-D inputs only, an `RMSNorm` with `eps` outside the square root or Gemma's `1 + w`, a per-instance scale
parameter that is 1.0 on the first module only. `make` builds one such class; `swap_in` replaces a host tree's
modules of that short name by instances of it, carrying their weights over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: The perturbations a look-alike may carry (`plain`: the library's own math under a foreign class).
PERTURBATIONS = ("plain", "rank-term", "instance-scale", "eps-outside", "one-plus-weight")
#: Which perturbations each base computation can carry.
BASES = {
    "linear": ("plain", "rank-term", "instance-scale"),
    "rms_norm": PERTURBATIONS,
    "embedding": ("plain", "rank-term", "instance-scale"),
    "conv1d": ("plain", "rank-term", "instance-scale"),
}


def make(name: str, base: str, perturbation: str, rank: int = 3) -> type[nn.Module]:
    """A class called `name` (in a module of its own) computing `base` with `perturbation`; `rank`: the input rank
    a `rank-term` applies to."""
    if perturbation not in BASES[base]:
        raise ValueError(f"{base} cannot carry {perturbation}")

    def finish(self, x, y):
        if perturbation == "rank-term" and x.dim() == rank:
            y = y + 0.25
        if perturbation == "instance-scale":
            y = y * self.scale
        return y

    def forward(self, x):
        return finish(self, x, _COMPUTE[base](self, x, perturbation))

    return type(name, (nn.Module,), {"forward": forward, "__module__": "look_alike_models"})


def _linear(self, x, perturbation):
    return F.linear(x, self.weight, self.bias)


def _rms_norm(self, x, perturbation):
    dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    if perturbation == "eps-outside":
        hidden = hidden * (torch.rsqrt(variance) + self.variance_epsilon)
    else:
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
    weight = 1 + self.weight if perturbation == "one-plus-weight" else self.weight
    return weight * hidden.to(dtype)


def _embedding(self, x, perturbation):
    return F.embedding(x, self.weight, self.padding_idx)


def _conv1d(self, x, perturbation):
    return F.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


_COMPUTE = {"linear": _linear, "rms_norm": _rms_norm, "embedding": _embedding, "conv1d": _conv1d}
# What each base takes over from the module it replaces: every attribute the library's kind would read too.
_CARRIED = {
    "linear": ("in_features", "out_features"),
    "rms_norm": ("variance_epsilon",),
    "embedding": ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                  "sparse"),
    "conv1d": ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
               "padding_mode", "_reversed_padding_repeated_twice", "transposed", "output_padding"),
}


def swap_in(model: nn.Module, cls: type[nn.Module], base: str, perturbation: str, *, seed: int = 0) -> int:
    """Replace every module of `model` whose class has `cls`'s short name by a `cls`, with its tensors and the
    attributes its base computation reads; the first gets an instance scale of 1.0, the others random ones.
    Returns how many were replaced."""
    generator = torch.Generator().manual_seed(seed)
    targets = [(path, module) for path, module in model.named_modules() if type(module).__name__ == cls.__name__
               and type(module) is not cls]
    for index, (path, old) in enumerate(targets):
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name, tensor in old._parameters.items():
            new.register_parameter(name, tensor)
        for name, tensor in old._buffers.items():
            new.register_buffer(name, tensor)
        for name in _CARRIED[base]:
            if hasattr(old, name):
                object.__setattr__(new, name, getattr(old, name))
        if base == "rms_norm" and not hasattr(new, "variance_epsilon"):
            new.variance_epsilon = getattr(old, "eps", 1e-6)
        if perturbation == "instance-scale":
            value = 1.0 if index == 0 else 0.5 + torch.rand((), generator=generator).item()
            new.scale = nn.Parameter(torch.tensor(value))
        new.train(old.training)
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, new)
    return len(targets)
