"""A commented, valid policy drafted for a model no policy knows, stranding nothing (`streamwise policy draft`).

The draft is read off the live tree (a model built on the meta device works: nothing is computed):
- every class whose modules hold parameters gets a stream rule: the kind `fit("auto", cls)` proves for the class
  where every module of it is a leaf holding only what that kind fetches (`weight`, `bias`), else `generic` (its
  own forward, right by construction); classes of one kind share one rule, and each class carries the reason as a
  comment;
- classes whose modules hold only buffers (rotary tables) get a relocate rule;
- optional catch-alls (`holds`) after them cover classes that other configs of the model may build;
- `[compile] blocks` lists the model's declared repeated blocks (`_no_split_modules`), compilation off;
- `[quant]` is a commented-out example (quantization is opt-in).

The text is written by hand (the project reads TOML, it has no writer): strings are JSON strings, which are TOML
basic strings once DEL is escaped too. `draft_policy(model)` is the Python entry point; the command
(`streamwise policy draft`) is `cli/draft.py`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from ...errors import Error
from ...schemas.patterns import PatternError, check_class_name, is_policy_name
from ..engine.kinds import COMPUTE_KINDS, FETCHED, GENERIC, fit
from ..engine.protocol import original_class
from .selectors import declared_blocks, holds, walk_modules

COMMAND = "streamwise policy draft"  # the command that writes drafts, named in them
SCHEMA_HEADER = "#:schema ../schemas/policy.v1.schema.json"
_QUANT_MIN_WEIGHTS = 65536
_RULE = "─" * 95


class DraftError(Error, ValueError):
    pass


@dataclass
class _Family:
    """The modules of one class, as the draft sees them."""

    cls: type
    entry: str = ""  # the selector's class entry: the short name, qualified where short names collide
    held: dict[str | None, list[str]] = field(default_factory=dict)  # paths by what the module holds
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    kind: str = GENERIC
    reason: str = ""
    merged: int = 1  # how many classes share the entry (classes named alike whose qualified names are no entries)

    @property
    def short(self) -> str:
        return self.cls.__name__

    @property
    def with_parameters(self) -> list[str]:
        return self.held.get("parameters", [])

    @property
    def buffers_only(self) -> list[str]:
        return self.held.get("buffers-only", [])


def draft_policy(model: nn.Module, *, name: str | None = None, spec: str | None = None) -> str:
    """The TOML text of a policy for `model` that streams or relocates every tensor it holds.

    `name` is the policy name (default: derived from the root class, see `policy_name`); `spec` is how the model
    was built (`transformers:Qwen2ForCausalLM`), named in the header comment.
    """
    root = original_class(type(model)).__name__
    name = policy_name(root) if name is None else name
    if not is_policy_name(name):
        raise DraftError(f"`{name}` is not a valid policy name: use letters, digits, `_`, `-` and `.`")
    walk = walk_modules(model)
    families = _families(walk)
    streamed = [f for f in families if f.with_parameters]
    relocated = [f for f in families if not f.with_parameters and f.buffers_only]
    for family in streamed:
        family.kind, family.reason = _kind(family)

    out: list[str] = []
    _header(out, root, spec)
    out += ["", "[policy]", f"name = {_string(name)}" + _pad(name) + "# must equal the file name without .toml",
            "description = " + _string(
                f"Drafted by `{COMMAND}` for {root}: every parameter-holding module streams (proven fast kinds where "
                "they apply, else its own forward), buffer-only modules follow the compute device. Review it.")]
    _match(out, model, root)
    _stream(out, streamed)
    _relocate(out, relocated)
    _quant(out, model, walk, streamed)
    _compile(out, walk, families)
    return "\n".join(out) + "\n"


def policy_name(root_class: str) -> str:
    """A policy name from a class name: `Qwen2ForCausalLM` -> `qwen2-for-causal-lm`."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", root_class).lower()
    words = re.sub(r"[^a-z0-9_.-]+", "-", words).replace("..", ".").strip("-.")
    return words if words and is_policy_name(words) else "drafted"


# -- reading the model ------------------------------------------------------------------------------------------------
def _families(walk: list[tuple[str, nn.Module]]) -> list[_Family]:
    """One family per class, in walk order, with its modules grouped by what they hold."""
    by_class: dict[type, _Family] = {}
    for path, module in walk:
        cls = original_class(type(module))
        family = by_class.get(cls)
        if family is None:
            family = by_class[cls] = _Family(cls)
        family.held.setdefault(holds(module), []).append(path)
        family.modules.append((path, module))
    families: list[_Family] = []
    short_names: dict[str, list[_Family]] = {}
    for family in by_class.values():
        short_names.setdefault(family.short, []).append(family)
    for family in by_class.values():
        same = short_names[family.short]
        qualified = [f"{f.cls.__module__}.{f.cls.__qualname__}" for f in same]
        if len(same) == 1:
            family.entry = family.short
        elif len(set(qualified)) == len(same) and all(_valid_class_entry(q) for q in qualified):
            family.entry = qualified[same.index(family)]
        elif family is same[0]:  # the classes cannot be told apart by name: one entry, one rule for them all
            family.entry, family.merged = family.short, len(same)
            for other in same[1:]:
                for held, paths in other.held.items():
                    family.held.setdefault(held, []).extend(paths)
                family.modules += other.modules
        else:
            continue
        families.append(family)
    return families


def _valid_class_entry(name: str) -> bool:
    try:
        check_class_name(name)
    except PatternError:
        return False
    return True


def _kind(family: _Family) -> tuple[str, str]:
    """The kind the family's rule names, and why: `auto`'s choice where it holds for every module, else generic."""
    if family.merged > 1:
        return GENERIC, f"{family.merged} classes are named `{family.short}`; each module's own forward"
    chosen = fit("auto", family.cls)
    if chosen.kind == GENERIC:
        return GENERIC, _why_generic(family.cls, chosen.reason)
    if family.buffers_only:
        return GENERIC, (f"`{chosen.kind}` reproduces `{family.short}`, but some of its modules hold only buffers "
                         f"(`{family.buffers_only[0]}`); its own forward")
    kind = COMPUTE_KINDS[chosen.kind]
    for path, module in family.modules:
        where = f"`{path or '<root>'}`"
        extra = [n for n, t in module._parameters.items() if t is not None and n not in FETCHED]
        buffers = [n for n, t in module._buffers.items() if t is not None]
        missing = kind.missing(module)
        problem = (
            f"{where} also holds parameter `{extra[0]}`, which the kind does not fetch" if extra
            else f"{where} holds buffer `{buffers[0]}`, which the kind does not fetch" if buffers
            else f"{where} holds modules with parameters, which the kind does not compute" if _parameters_below(module)
            else f"{where} has no {', '.join(missing)}, which the kind reads" if missing
            else None
        )
        if problem is not None:
            return GENERIC, f"`{chosen.kind}` reproduces `{family.short}`, but {problem}; its own forward"
    return chosen.kind, _plain(fit(chosen.kind, family.cls).reason)


def _why_generic(cls: type, reason: str) -> str:
    """Why no specific kind: the kind made for a base of the class and why it is refused, else `auto`'s reason."""
    for kind in COMPUTE_KINDS.values():
        if kind.name != GENERIC and any(issubclass(cls, base) for base in kind.made_for):
            refused = fit(kind.name, cls).refused
            if refused is not None:
                return f"{refused}; its own forward"
    return _plain(reason)


def _parameters_below(module: nn.Module) -> bool:
    return any(True for child in module.children() for _ in child.parameters())


def _plain(reason: str) -> str:
    return reason.removeprefix("auto: ")


# -- writing the sections ---------------------------------------------------------------------------------------------
def _header(out: list[str], root: str, spec: str | None) -> None:
    built = f" ({_comment(spec)})" if spec else ""
    out += [
        SCHEMA_HEADER,
        f"# Drafted by `{COMMAND}` for {root}{built}.",
        "# Every module that holds parameters streams: with a specific compute kind where one provably reproduces",
        "# its class, through its own forward (`generic`) otherwise. Every module that holds only buffers follows",
        "# the compute device. Nothing is stranded. Review it, rename it if you like (the file name must equal",
        "# [policy].name), and check it with `policy-validate --model SPEC <file>`.",
        "",
        "# The format version this file is written in.",
        "schema_version = 1",
    ]


def _match(out: list[str], model: nn.Module, root: str) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    out += ["", "# How `auto` policy selection recognizes the model: its root class"
            + (" and its config's model_type." if isinstance(model_type, str) and model_type else "."),
            "# Two policies that match a model equally are an error: drop what a family policy already claims.",
            "[match]", f"classes = [{_string(root)}]"]
    if isinstance(model_type, str) and model_type:
        out.append(f"model_types = [{_string(model_type)}]")


def _stream(out: list[str], families: list[_Family]) -> None:
    out += [
        "", _section("stream"),
        "# Modules whose weights stream between the offload device and the compute device, and how each computes.",
        "# One rule per compute kind, naming its classes: `kind = \"auto\"` chose each kind from the class. A",
        "# specific kind is a fast path for the classes it provably reproduces; `generic` runs the module's own",
        "# forward with its direct parameters fetched (containers too), right by construction; a module whose",
        "# forward takes no tensor cannot stream that way: relocate it instead. Each `[stream.rule.select]` is",
        "# the rule's selector, written as a table so that every class carries its reason.",
    ]
    kinds: dict[str, list[_Family]] = {}
    for family in families:
        kinds.setdefault(family.kind, []).append(family)
    ordered = [k for k in kinds if k != GENERIC] + ([GENERIC] if GENERIC in kinds else [])
    for kind in ordered:
        out += ["", "[[stream.rule]]", f"id = {_string(kind)}", f"kind = {_string(kind)}", "[stream.rule.select]"]
        out += _class_list([(f.entry, _census(f.with_parameters) + ": " + f.reason) for f in kinds[kind]])
    out += [
        "",
        "# A safety net for other configs of this model, which may build classes not named above: any other module",
        "# holding parameters streams too, with `auto`'s choice. The class rules above beat it.",
        "[[stream.rule]]", 'id = "other-parameters"', 'kind = "auto"', 'select = { holds = "parameters" }',
        "optional = true",
    ]


def _relocate(out: list[str], families: list[_Family]) -> None:
    out += [
        "", _section("relocate"),
        "# Modules whose direct tensors follow the compute device: those holding only buffers (rotary `inv_freq`",
        "# tables), which a partial load never moves by itself.",
    ]
    if families:
        out += ["", "[[relocate.rule]]", 'id = "buffers"', "[relocate.rule.select]"]
        out += _class_list([(f.entry, _census(f.buffers_only) + ": buffers " + ", ".join(_buffers(f)))
                            for f in families])
    else:
        out.append("# (this model has no module that holds only buffers)")
    out += ["", "# The safety net: any other module holding only buffers.",
            "[[relocate.rule]]", 'id = "other-buffers"', 'select = { holds = "buffers-only" }', "optional = true"]


def _quant(out: list[str], model: nn.Module, walk: list[tuple[str, nn.Module]], families: list[_Family]) -> None:
    out += ["", _section("quant"),
            "# How weights are stored. Formats: none, gguf, int8, convrot_int8, convrot_int4 (see the template)."]
    linears = [f.entry for f in families if issubclass(f.cls, nn.Linear) and f.kind == "linear"]
    if not linears:
        out += ["# Quantization is opt-in. This model has no torch.nn.Linear layer streamed as `linear`, and the",
                "# int8 formats apply to Linear layers only: see the README for `gguf` quantization instead."]
        return
    keep = [f.entry for f in families if _is_norm_or_embedding(f.cls)]
    heads = _heads(model, walk)
    exclude = ", ".join(part for part in (
        f"class = [{', '.join(map(_string, keep))}]" if keep else "",
        f"path = [{', '.join(map(_string, heads))}]" if heads else "",
    ) if part)
    selected = _string(linears[0]) if len(linears) == 1 else f"[{', '.join(map(_string, linears))}]"
    out += ["# Quantization is opt-in: uncomment this example to hold Linear weights as INT8 (per-row scales).",
            "# Norms, embeddings and the output head stay float: they are small, or sensitive to rounding (the",
            "# exclude names them in case a rule is broadened).", "#"]
    if exclude:
        out += ["# [quant]", f"# exclude = {{ {exclude} }}", "#"]
    out += ["# [[quant.rule]]", '# id = "linears"', f"# select = {{ class = {selected} }}",
            '# format = "int8"', f"# min_weights = {_QUANT_MIN_WEIGHTS}         # layers smaller than this stay float"]


def _compile(out: list[str], walk: list[tuple[str, nn.Module]], families: list[_Family]) -> None:
    declared = declared_blocks(walk)  # short names, as the model declares them
    blocks = [f.short for f in families if f.short in declared]
    out += ["", _section("compile"),
            "# torch.compile, applied lazily on the first forward once enabled; the compile node's inputs override"]
    if blocks:
        out += ["# these. The blocks are the classes the model declares as its repeated blocks (`_no_split_modules`),",
                "# compiled regionally: one graph per structure."]
    else:
        out += ["# these. The model declares no repeated blocks (`_no_split_modules`), so the whole model compiles;",
                '# name them, `blocks = { class = ["MyBlock"] }`, to compile regionally.']
    out += ["[compile]", "enabled = false                     # compile when a host takes the policy"]
    if blocks:
        out.append(f"blocks = {{ class = [{', '.join(map(_string, blocks))}] }}")


# -- helpers ----------------------------------------------------------------------------------------------------------
def _section(title: str) -> str:
    return f"# ── {title} " + _RULE[: max(3, 89 - len(title))]


def _class_list(items: Iterable[tuple[str, str]]) -> list[str]:
    items = list(items)
    width = max(len(_string(entry)) for entry, _ in items) + 1
    lines = ["class = ["]
    lines += [f"    {(_string(entry) + ','):<{width}}  # {_comment(why)}" for entry, why in items]
    return [*lines, "]"]


def _census(paths: list[str]) -> str:
    shown = f"`{paths[0] or '<root>'}`"
    return f"1 module, {shown}" if len(paths) == 1 else f"{len(paths)} modules, e.g. {shown}"


def _buffers(family: _Family) -> list[str]:
    names: dict[str, None] = {}
    for _, module in family.modules:
        names.update((f"`{n}`", None) for n, t in module._buffers.items() if t is not None)
    return list(names)


def _is_norm_or_embedding(cls: type) -> bool:
    return issubclass(cls, nn.Embedding) or any(word in cls.__name__ for word in ("Norm", "Embedding"))


def _heads(model: nn.Module, walk: list[tuple[str, nn.Module]]) -> list[str]:
    """Paths of the output head: the model's declared output embeddings, else Linear layers called `lm_head`."""
    declared = None
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            declared = get()
        except Exception:  # a model's own accessor may fail on a variant; the head is only a hint
            declared = None
    return [path for path, module in walk if path and (
        module is declared or declared is None and path.rsplit(".", 1)[-1] == "lm_head"
        and isinstance(module, nn.Linear))]


def _string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, once DEL (which JSON leaves raw) is escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _comment(text: str) -> str:
    return " ".join(text.split())


def _pad(text: str, width: int = 30) -> str:
    return " " * max(1, width - len(_string(text)) - len("name = "))
