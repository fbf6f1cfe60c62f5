"""The Plan: what a policy does to one concrete module tree, decided before anything changes.

`resolve` produces it; `apply` carries it out; the CLI and the tests read it. It is plain,
sorted data: module paths with their roles and the rules that decided them, a coverage census
in bytes, and the diagnostics found while resolving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ...schemas import CompileSettings
from ..policy.diagnostics import Diagnostic, PolicyError
from ..sizes import human


class ModulePlan(NamedTuple):
    """One module with something to do (or something missed).

    A named tuple rather than a frozen dataclass: resolve makes one per converted module, and a tuple
    is built several times faster.
    """

    path: str
    class_name: str
    stream: str | None = None
    stream_rule: str | None = None
    relocate: tuple[str, ...] = ()
    relocate_rule: str | None = None
    quant: str | None = None
    quant_rule: str | None = None
    group_size: int | None = None
    gguf_type: str | None = None
    compile_unit: bool = False
    kind_reason: str | None = None
    """Why `stream` is the kind this module computes with (`auto`'s choice, or whether it is proven), or why a
    module a stream rule selected relocates instead."""


@dataclass(frozen=True)
class TensorRef:
    name: str
    kind: str  # "parameter" or "buffer"
    bytes: int
    owner_class: str = ""  # the short class name of the module holding it


@dataclass(frozen=True)
class Coverage:
    """Bytes of parameters and buffers by role, every tensor no rule handles, and what of a loaded tree is on its
    file tier now (bytes as stored in the file, and the modules holding them)."""

    bytes: dict[str, int]
    stranded: tuple[TensorRef, ...]
    tied: tuple[tuple[str, ...], ...] = ()
    file_bytes: int = 0
    file_modules: int = 0

    @property
    def complete(self) -> bool:
        return not self.stranded

    @property
    def fraction(self) -> float:
        total = sum(self.bytes.values())
        return 1.0 if total == 0 else 1 - self.bytes["stranded"] / total

    @property
    def percent(self) -> str:
        """The covered fraction for people: rounded down, so it never reads 100% while any byte is stranded."""
        hundredths = math.floor(self.fraction * 10_000)
        if self.bytes["stranded"] and hundredths >= 10_000:
            hundredths = 9_999
        return f"{hundredths / 100:.2f}%"


@dataclass(frozen=True)
class Plan:
    policy: str
    root_class: str
    compile: CompileSettings
    modules: tuple[ModulePlan, ...]
    coverage: Coverage
    rule_matches: dict[str, int] = field(default_factory=dict)
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)

    def refuse_stranded(self) -> None:
        """Raise PolicyError when the plan strands tensors: where a partial load would crash on them (a ComfyUI
        MODEL), its `stranded-tensors` warning becomes the error, naming the classes and the rule to add."""
        stranded = next((d for d in self.diagnostics if d.code == "stranded-tensors"), None)
        if stranded is not None:
            raise PolicyError([replace(
                stranded, severity="error",
                message=f"policy `{self.policy}` on `{self.root_class.rsplit('.', 1)[-1]}`: {stranded.message} "
                        "(accept it explicitly with allow_stranded)",
            )])

    def module(self, path: str) -> ModulePlan | None:
        return next((m for m in self.modules if m.path == path), None)

    def summary(self) -> dict:
        """A compact census: modules per role and class, bytes per role, rule match counts."""
        census: dict[str, dict[str, int]] = {}
        for module in self.modules:
            short = module.class_name.rsplit(".", 1)[-1]
            for role, active in (
                (f"stream:{module.stream}", module.stream),
                ("relocate", module.relocate),
                (f"quant:{module.quant}", module.quant),
                ("compile", module.compile_unit),
            ):
                if active:
                    census.setdefault(role, {}).setdefault(short, 0)
                    census[role][short] += 1
        return {
            "policy": self.policy,
            "root_class": self.root_class,
            "modules": {role: dict(sorted(classes.items())) for role, classes in sorted(census.items())},
            "bytes": dict(self.coverage.bytes),
            "stranded": [f"{t.name} ({t.kind}, {t.bytes} bytes)" for t in self.coverage.stranded],
            "tied": [list(group) for group in self.coverage.tied],
            **({"in_file": {"bytes": self.coverage.file_bytes, "modules": self.coverage.file_modules}}
               if self.coverage.file_modules else {}),  # a loaded tree's file tier
            "rule_matches": dict(sorted(self.rule_matches.items())),
            "diagnostics": [f"{d.severity}[{d.code}]: {d.message}" for d in self.diagnostics],
        }

    def __str__(self) -> str:
        return self.render()

    def render(self, *, rules: bool = True) -> str:
        """The plan for people, as `policy-validate --model` prints it (`str(plan)`): modules per role and class,
        bytes per role, rule match counts (unless `rules` is false), tied tensors; the diagnostics print on their
        own."""
        summary = self.summary()
        lines = [f"plan: policy `{self.policy}` on {self.root_class}"]
        for role, classes in summary["modules"].items():
            listed = ", ".join(f"{name} x{count}" for name, count in classes.items())
            lines.append(f"  {role:<24} {sum(classes.values()):>6}  {listed}")
        lines.append("coverage:")
        lines += [f"  {role:<24} {human(size):>12}" for role, size in summary["bytes"].items()]
        lines.append(f"  {'covered':<24} {self.coverage.percent:>12}")
        if self.coverage.file_modules:
            lines.append(f"  {'in the file':<24} {human(self.coverage.file_bytes):>12}  "
                         f"({self.coverage.file_modules} modules read at each fetch; the rest in memory)")
        if rules:
            lines.append("rules:")
            lines += [f"  {rule:<40} {count:>6} modules" for rule, count in summary["rule_matches"].items()]
        if summary["tied"]:
            lines.append("tied: " + "; ".join(" = ".join(group) for group in summary["tied"]))
        return "\n".join(lines)
