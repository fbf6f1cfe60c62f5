"""Pydantic models of the policy format, version 1.

Invariants:
- the single source of truth: the loader validates TOML against these models and `schemas/policy.v1.schema.json`
  is generated from them (attribute docstrings become the editors' hover text), so the two cannot disagree;
- frozen: a loaded policy is a value; `extends` builds a new one by copying, never by editing the parent;
- unknown keys are refused, so a typo is an error with a suggestion, never a silently ignored key;
- strict types: TOML has real booleans and integers, so `"yes"` is a mistake, not a boolean;
- what the runtime checks too (names, group sizes, `Policy.RULE_SECTIONS`) is defined once here or in
  `patterns`/`vocabulary`, so the runtime imports it instead of keeping a copy.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, model_validator
from pydantic.json_schema import WithJsonSchema
from pydantic_core import PydanticCustomError

from .patterns import (
    CLASS_NAME_SCHEMA,
    MAX_PATTERN_LENGTH,
    POLICY_NAME_SCHEMA,
    PatternError,
    check_class_name,
    compile_glob,
    compile_regex,
    is_policy_name,
)
from .vocabulary import (
    AUTO_KIND,
    COMPILE_MODES,
    COMPUTE_KINDS,
    DEFAULT_GGUF_TYPE,
    DEFAULT_GROUP_SIZE,
    GGUF_WRITE_TYPES,
    GROUPED_QUANT_FORMATS,
    HOLDS,
    QUANT_FORMATS,
    is_power_of_4,
)

SCHEMA_VERSION = 1

ComputeKind = Literal[(*COMPUTE_KINDS, AUTO_KIND)]
Holds = Literal[tuple(HOLDS)]
QuantFormat = Literal[tuple(QUANT_FORMATS)]
CompileMode = Literal[tuple(COMPILE_MODES)]
GGUFType = Literal[GGUF_WRITE_TYPES]

_BACKEND = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BACKEND_SCHEMA = r"^[A-Za-z_][A-Za-z0-9_]*$"


def _checked(code: str, check: Callable[[str], Any]) -> Callable[[str], str]:
    """Wrap a pattern check so that its failure becomes a located diagnostic with `code`."""

    def validate(value: str) -> str:
        try:
            check(value)
        except PatternError as exc:
            raise PydanticCustomError(code, "{detail}", {"detail": exc.message, "offset": exc.offset}) from None
        return value

    return validate


def _check_name(value: str) -> None:
    if not is_policy_name(value):
        raise PatternError(f"`{value}` is not a valid name: use letters, digits, `_`, `-` and `.`")


def _check_backend(value: str) -> None:
    if not _BACKEND.fullmatch(value):
        raise PatternError(f"`{value}` is not a backend name (an identifier such as `inductor`)")


def _as_tuple(value: Any) -> Any:
    """Accept one string where a list of strings is expected (`class = "Linear"`)."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _array(item: Any) -> Any:
    """A TOML array held as a tuple (strict mode refuses lists for tuples unless converted)."""
    return Annotated[tuple[item, ...], BeforeValidator(_list_to_tuple)]


def _no_boolean(value: Any) -> Any:
    """TOML's `true` is no integer (a `Literal[1]` alone would take it: True == 1)."""
    if isinstance(value, bool):
        raise PydanticCustomError("invalid-type", "expected an integer, not a boolean")
    return value


def _list_to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _text(**constraints: Any) -> dict[str, Any]:
    """The JSON Schema of a string its validator accepts, as far as a schema can say (a `pattern` is anchored with
    `^...$`, which a Python `re.search` also matches before a final newline: so no newline at all)."""
    schema: dict[str, Any] = {"type": "string", **constraints}
    if "pattern" in constraints:
        schema["not"] = {"pattern": "\n"}
    return schema


# What a class entry is to the schema: the class-name pattern, and a glob's length limit where it holds a wildcard.
_CLASS_ENTRY = _text(pattern=CLASS_NAME_SCHEMA) | {"if": {"pattern": "[*?]"},
                                                   "then": {"maxLength": MAX_PATTERN_LENGTH}}


def _entries(check: Callable[[str], str], item: dict[str, Any]) -> Any:
    text = Annotated[str, WithJsonSchema(item)]
    return Annotated[
        tuple[Annotated[str, AfterValidator(check)], ...],
        BeforeValidator(_as_tuple, json_schema_input_type=text | list[text]),
    ]


Name = Annotated[str, AfterValidator(_checked("invalid-value", _check_name)),
                 WithJsonSchema(_text(pattern=POLICY_NAME_SCHEMA))]
ClassNames = _entries(_checked("invalid-value", check_class_name), _CLASS_ENTRY)
PathGlobs = _entries(_checked("bad-glob", compile_glob), _text(maxLength=MAX_PATTERN_LENGTH))
Regexes = _entries(_checked("bad-regex", compile_regex), _text(maxLength=MAX_PATTERN_LENGTH))


class _Table(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, populate_by_name=True
    )

    @model_validator(mode="before")
    @classmethod
    def _no_null(cls, data: Any) -> Any:
        """TOML has no null, and neither does a policy: an optional key is left out, never given as None."""
        if isinstance(data, dict):
            given_none = [key for key, value in data.items() if value is None]
            if given_none:
                raise ValueError(f"{', '.join(map(repr, given_none))}: leave an optional key out instead of None")
        return data


def _one_entry(schema: dict[str, Any], cls: type[Selector]) -> None:
    """The schema of a selector holds at least one entry (`Selector._not_empty`): a non-empty list, a string, a
    `holds`, or `no_split = true`."""
    given = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}
    branches = [{"required": [key], "properties": {key: given}} for key in ("class", "path", "regex")]
    branches.append({"required": ["holds"]})
    if "no_split" in cls.model_fields:
        branches.append({"required": ["no_split"], "properties": {"no_split": {"const": True}}})
    schema["anyOf"] = branches


class Selector(_Table):
    """Which modules a rule addresses. Entries are OR-ed; at least one is required."""

    model_config = ConfigDict(json_schema_extra=_one_entry)

    class_: ClassNames = Field(default=(), alias="class")
    """Class names (`Linear`), `package.module.Qualname` to tell apart equal short names, or globs of either
    (`*RMSNorm`)."""
    path: PathGlobs = ()
    """Dotted module-path globs, matched segment by segment against the whole path (`*`, `**`, `?`, `[...]`)."""
    regex: Regexes = ()
    """Regexes in the part of Python's syntax that RE2 reads alike (no backreferences, no lookarounds), full-matched
    against the dotted module path in linear time. Prefer TOML literal strings: '...'."""
    subclasses: bool = False
    """Also match subclasses of the named classes (by walking each module's MRO)."""
    holds: Holds | None = None
    """The catch-all, least specific of all: `parameters` (any module with direct parameters) or `buffers-only`
    (direct buffers and no direct parameters)."""

    _ENTRIES: ClassVar[str] = "`class`, `path`, `regex` or `holds`"

    @model_validator(mode="after")
    def _not_empty(self) -> Selector:
        if not self.entries:
            raise PydanticCustomError("empty-selector", "a selector needs at least one of {entries}",
                                      {"entries": self._ENTRIES})
        return self

    @property
    def entries(self) -> bool:
        """Whether the selector names anything to match."""
        return bool(self.class_ or self.path or self.regex or self.holds)


class BlockSelector(Selector):
    """The compile blocks: a selector, or the model's own declaration of its repeated blocks."""

    no_split: bool = False
    """The classes the model declares as its repeated blocks (transformers' `_no_split_modules`, read from the live
    classes as data)."""

    _ENTRIES: ClassVar[str] = "`class`, `path`, `regex`, `holds` or `no_split`"

    @property
    def entries(self) -> bool:
        return super().entries or self.no_split


class _Rule(_Table):
    id: Name
    """Unique within its section. A policy that extends another replaces the parent's rule with the same id."""
    select: Selector
    """The modules this rule addresses."""
    optional: bool = False
    """Allow this rule to match nothing in a model (for policies that cover several model variants)."""

    _origin: Any = PrivateAttr(default=None)

    @property
    def decision(self) -> Any:
        """What the rule does to a module; two rules that tie must agree on it."""
        return type(self).__name__


class StreamRule(_Rule):
    """Modules whose weights stream under low VRAM, computed as `kind`."""

    kind: ComputeKind
    """How the streamed module computes its forward: a specific kind (a leaf of the class it was made for),
    `generic` (any module, through its own forward) or `auto` (per class, the best that is provably right)."""

    @property
    def decision(self) -> Any:
        return self.kind


class RelocateRule(_Rule):
    """Containers whose direct parameters and buffers follow the compute device."""


_POWERS_OF_4 = [4**k for k in range(1, 32)]  # every power of 4 a TOML (64-bit) integer holds


class QuantRule(_Rule):
    """Leaf modules whose weights are held in a quantized format."""

    model_config = ConfigDict(json_schema_extra={"dependencies": {  # the validators below, for editors
        "gguf_type": {"properties": {"format": {"const": "gguf"}}},
        "group_size": {"properties": {"format": {"enum": sorted(GROUPED_QUANT_FORMATS)}}},
    }})

    format: QuantFormat
    """The storage format. `none` keeps float weights and beats any less specific rule."""
    group_size: int | None = Field(default=None, json_schema_extra={"enum": _POWERS_OF_4})
    """ConvRot only: Hadamard group size, a power of 4 that divides in_features (default 256)."""
    gguf_type: GGUFType | None = None
    """`gguf` only: the GGML type `streamwise quantize` writes for these layers (default Q8_0)."""
    min_weights: int = Field(default=0, ge=0)
    """Leave layers with fewer weight elements than this in float (small layers gain little)."""

    @model_validator(mode="after")
    def _gguf_type_fits_format(self) -> QuantRule:
        if self.gguf_type is not None and self.format != "gguf":
            raise PydanticCustomError(
                "invalid-value", "`gguf_type` applies only to the `gguf` format, not to `{format}`",
                {"format": self.format, "field": "gguf_type"},
            )
        return self

    @property
    def effective_gguf_type(self) -> str | None:
        return (self.gguf_type or DEFAULT_GGUF_TYPE) if self.format == "gguf" else None

    @model_validator(mode="after")
    def _group_size_fits_format(self) -> QuantRule:
        size = self.group_size
        if size is None:
            return self
        if self.format not in GROUPED_QUANT_FORMATS:
            raise PydanticCustomError(
                "invalid-value",
                "`group_size` applies only to the formats {formats}, not to `{format}`",
                {"formats": ", ".join(sorted(GROUPED_QUANT_FORMATS)), "format": self.format, "field": "group_size"},
            )
        if not is_power_of_4(size):
            raise PydanticCustomError(
                "invalid-value",
                "`group_size` must be a power of 4 (4, 16, 64, 256, 1024, ...), found {size}",
                {"size": size, "field": "group_size"},
            )
        return self

    @property
    def decision(self) -> Any:
        return (self.format, self.effective_group_size, self.effective_gguf_type, self.min_weights)

    @property
    def effective_group_size(self) -> int | None:
        if self.format not in GROUPED_QUANT_FORMATS:
            return None
        return self.group_size or DEFAULT_GROUP_SIZE


class RuleSection(_Table):
    exclude: Selector | None = None
    """Modules this section never touches; an exclusion always beats every rule."""


class StreamSection(RuleSection):
    rule: _array(StreamRule) = ()
    """The stream rules (`[[stream.rule]]`)."""


class RelocateSection(RuleSection):
    rule: _array(RelocateRule) = ()
    """The relocation rules (`[[relocate.rule]]`)."""


class QuantSection(RuleSection):
    rule: _array(QuantRule) = ()
    """The quantization rules (`[[quant.rule]]`)."""


class PolicyInfo(_Table):
    name: Name
    """The policy's name; it must equal the file name without `.toml`."""
    description: str = ""
    """One or two sentences shown next to the policy in pickers and reports."""
    extends: Name | None = None
    """Name of a policy this one builds on (see the README for the merge rules)."""


class Match(_Table):
    """How `auto` policy selection recognizes a model. Never inherited through `extends`."""

    classes: ClassNames = ()
    """Class names of the model's root module."""
    model_types: _array(str) = ()
    """Values of the model config's `model_type`."""
    state_dict_keys: PathGlobs = ()
    """Path globs over state-dict keys; every glob must match at least one key."""
    base_classes: ClassNames = ()
    """Class names anywhere in the root module's MRO (`PreTrainedModel`): a whole library's fallback, weaker than
    the three above."""
    fallback: bool = False
    """The policy for any model no other policy recognizes (the weakest match)."""


class CompileSettings(_Table):
    """torch.compile settings, applied lazily on the first forward."""

    model_config = ConfigDict(json_schema_extra={  # `_mode_fits_backend`, for editors
        "if": {"required": ["mode"], "properties": {"mode": {"not": {"const": "default"}}}},
        "then": {"properties": {"backend": {"const": "inductor"}}},
    })

    enabled: bool = False
    """Arm compilation when a host takes the policy (`offload`, `model_patcher(policy=)`, the Apply node)."""
    backend: Annotated[str, AfterValidator(_checked("invalid-value", _check_backend)),
                       WithJsonSchema(_text(pattern=_BACKEND_SCHEMA))] = "inductor"
    """A torch.compile backend; checked against the running torch when compiling."""
    mode: CompileMode = "default"
    """The torch.compile mode."""
    fullgraph: bool = False
    """Fail instead of splitting a graph at unsupported code."""
    dynamic: bool = False
    """Trace shapes symbolically instead of specializing on the first shapes seen."""
    blocks: BlockSelector | None = None
    """The repeated block classes to compile regionally; without it the whole model is compiled."""
    dynamo_cache_size_limit: int = Field(default=64, ge=1, le=65536)
    """How many compiled variants torch keeps per code object before falling back to eager."""
    use_guard_filter: bool = True
    """Drop guards on per-call dictionaries such as ComfyUI's `transformer_options`."""
    disable_dynamic_vram: bool = False
    """Demote a ComfyUI MODEL to a non-dynamic-VRAM patcher before compiling."""
    verbose: bool = False
    """Log compile preparation, graph-cache growth, timings and recompile reasons."""

    @model_validator(mode="after")
    def _mode_fits_backend(self) -> CompileSettings:
        if self.mode != "default" and self.backend != "inductor":
            raise PydanticCustomError(
                "invalid-value", "compile mode `{mode}` is an inductor setting; backend `{backend}` takes none",
                {"mode": self.mode, "backend": self.backend, "field": "mode"},
            )
        return self


class Policy(_Table):
    """A Streamwise policy: how to stream, relocate, quantize and compile one model family."""

    schema_version: Annotated[Literal[1], BeforeValidator(_no_boolean)]
    """The policy format version this file is written in."""
    policy: PolicyInfo
    """Name, description and inheritance."""
    match: Match = Match()
    """How `auto` selection recognizes a model."""
    stream: StreamSection = StreamSection()
    """Leaf modules that stream their weights, and with which compute kind."""
    relocate: RelocateSection = RelocateSection()
    """Containers whose direct parameters and buffers follow the compute device."""
    quant: QuantSection = QuantSection()
    """Quantization formats per module."""
    compile: CompileSettings = CompileSettings()
    """torch.compile settings."""

    RULE_SECTIONS: ClassVar[tuple[str, ...]] = ("stream", "relocate", "quant")
    """The sections made of `[[<section>.rule]]` arrays and an `exclude`, in the order they are decided."""

    _source: Any = PrivateAttr(default=None)

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def source(self) -> str | None:
        """The file this policy was loaded from, when it came from a file."""
        return self._source
