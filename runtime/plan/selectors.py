"""Matching selectors against modules, and how specific each match is.

A module is seen only through a `ModuleRef`: its dotted path and the names of its class and the
class's bases. Matching therefore needs neither torch nor the module's code, and a policy never
causes an import: class entries are compared by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...schemas import Selector
from ...schemas.patterns import compile_glob, compile_regex, glob_literal_segments, glob_matches, is_exact_path

# Specificity tiers, highest first (see the README's precedence table).
EXACT_PATH, GLOB_PATH, REGEX, CLASS = 4, 3, 2, 1
QUALIFIED_CLASS, SHORT_CLASS, SUBCLASS = 2, 1, 0

Specificity = tuple[int, int]


@dataclass(frozen=True)
class ModuleRef:
    """A module as selectors see it: its path, and (short name, `module.Qualname`) per class in its MRO."""

    path: str
    classes: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, path: str, module: object) -> "ModuleRef":
        """A converted module is seen as its original class, so a policy resolves alike before and after."""
        original = getattr(type(module), "_sw_original_class", type(module))
        mro = original.__mro__[:-1]  # without `object`
        return cls(path, tuple((c.__name__, f"{c.__module__}.{c.__qualname__}") for c in mro))


def within(path: str, outer: str) -> bool:
    """Whether the module at `path` lies inside the module at `outer` ("" is the root)."""
    return outer == "" or path.startswith(outer + ".")


class CompiledSelector:
    """A selector with its globs and regexes compiled once, ready to test many modules."""

    def __init__(self, selector: Selector) -> None:
        self.selector = selector
        self._globs = [(compile_glob(g), _glob_specificity(g)) for g in selector.path]
        self._regexes = [compile_regex(r) for r in selector.regex]
        self._classes = selector.class_

    def specificity(self, module: ModuleRef) -> Specificity | None:
        """How specifically this selector names `module`, or None when it does not match it."""
        best: Specificity | None = None
        for pattern, specificity in self._globs:
            if glob_matches(pattern, module.path):
                best = max(best or specificity, specificity)
        if best is None and any(r.fullmatch(module.path) for r in self._regexes):
            best = (REGEX, 0)
        if best is None:
            best = self._class_specificity(module)
        return best

    def matches(self, module: ModuleRef) -> bool:
        return self.specificity(module) is not None

    def _class_specificity(self, module: ModuleRef) -> Specificity | None:
        candidates = module.classes if self.selector.subclasses else module.classes[:1]
        best = None
        for depth, (short, qualified) in enumerate(candidates):
            for entry in self._classes:
                if entry != qualified and entry != short:
                    continue
                level = SUBCLASS if depth else (QUALIFIED_CLASS if entry == qualified else SHORT_CLASS)
                best = max(best or (CLASS, level), (CLASS, level))
        return best


def _glob_specificity(glob: str) -> Specificity:
    return (EXACT_PATH, 0) if is_exact_path(glob) else (GLOB_PATH, glob_literal_segments(glob))
