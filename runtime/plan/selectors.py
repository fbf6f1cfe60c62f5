"""Matching selectors against modules, and how specific each match is.

A module is seen only through its dotted path and the names of its class and the class's bases.
Matching therefore needs neither torch nor the module's code, and a policy never causes an
import: class entries are compared by name. What a selector makes of a class depends on the
class alone, so a `CompiledSelector` decides it once per class; only path globs and regexes are
tried per path. `walk_modules` and `outermost` are the tree walks resolve and compile share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar
from weakref import WeakKeyDictionary

from ...schemas import Selector
from ...schemas.patterns import compile_glob, compile_regex, glob_literal_segments, glob_matches, is_exact_path
from ..engine.protocol import original_class  # a converted module is seen as its original class

# Specificity tiers, highest first (see the README's precedence table).
EXACT_PATH, GLOB_PATH, REGEX, CLASS = 4, 3, 2, 1
QUALIFIED_CLASS, SHORT_CLASS, SUBCLASS = 2, 1, 0

Specificity = tuple[int, int]
ClassNames = tuple[tuple[str, str], ...]  # (short name, `module.Qualname`) per class of an MRO
T = TypeVar("T")
Walk = Iterable[tuple[str, object]]  # (path, module) pairs in `named_modules()` order


def class_names(cls: type) -> ClassNames:
    """The names selectors compare for instances of `cls` (its original class's MRO, without `object`).

    Memoized per class, weakly: every selector and section asks on first sight of a class.
    """
    names = _NAMES.get(cls)
    if names is None:
        mro = original_class(cls).__mro__[:-1]
        names = _NAMES[cls] = tuple((c.__name__, f"{c.__module__}.{c.__qualname__}") for c in mro)
    return names


_NAMES: WeakKeyDictionary[type, ClassNames] = WeakKeyDictionary()


class PerClass(dict, Generic[T]):
    """`compute(cls)` per class, worked out on first sight of the class (`cache[type(module)]`)."""

    def __init__(self, compute: Callable[[type], T]) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, cls: type) -> T:
        value = self[cls] = self.compute(cls)
        return value


@dataclass(frozen=True)
class ModuleRef:
    """A module as selectors see it: its path, and the names of the classes in its MRO."""

    path: str
    classes: ClassNames

    @classmethod
    def of(cls, path: str, module: object) -> ModuleRef:
        return cls(path, class_names(type(module)))

    @property
    def name(self) -> str:
        """The short class name (`Linear`)."""
        return self.classes[0][0]

    @property
    def qualname(self) -> str:
        """The qualified class name (`torch.nn.modules.linear.Linear`)."""
        return self.classes[0][1]


def within(path: str, outer: str) -> bool:
    """Whether the module at `path` lies inside the module at `outer` ("" is the root)."""
    return outer == "" or path.startswith(outer + ".")


class CompiledSelector:
    """A selector with its globs and regexes compiled once and its class verdicts cached per class."""

    def __init__(self, selector: Selector) -> None:
        self.selector = selector
        self._globs = [(compile_glob(g), _glob_specificity(g)) for g in selector.path]
        self._regexes = [compile_regex(r) for r in selector.regex]
        self._classes = frozenset(selector.class_)
        self.by_path = bool(self._globs or self._regexes)
        self.of_class: PerClass[Specificity | None] = PerClass(lambda cls: self.class_specificity(class_names(cls)))
        """`class_specificity` for instances of a class, decided once per class: `of_class[cls]`."""

    def specificity(self, module: ModuleRef) -> Specificity | None:
        """How specifically this selector names `module`, or None when it does not match it."""
        return self.path_specificity(module.path) or self.class_specificity(module.classes)

    def matches(self, module: ModuleRef) -> bool:
        return self.specificity(module) is not None

    def matches_module(self, path: str, module: object) -> bool:
        """`matches`, for a live module: its class verdict is cached."""
        return self.of_class[type(module)] is not None or (self.by_path and self.path_specificity(path) is not None)

    def path_specificity(self, path: str) -> Specificity | None:
        """The best match among the path globs, else a regex match, else None."""
        best: Specificity | None = None
        for pattern, specificity in self._globs:
            if glob_matches(pattern, path) and (best is None or specificity > best):
                best = specificity
        if best is None and any(r.fullmatch(path) for r in self._regexes):
            best = (REGEX, 0)
        return best

    def class_specificity(self, classes: ClassNames) -> Specificity | None:
        """Qualified name > short name > a base's name (with `subclasses`), or None."""
        if not self._classes:
            return None
        (short, qualified), *bases = classes
        if qualified in self._classes:
            return (CLASS, QUALIFIED_CLASS)
        if short in self._classes:
            return (CLASS, SHORT_CLASS)
        if self.selector.subclasses and any(s in self._classes or q in self._classes for s, q in bases):
            return (CLASS, SUBCLASS)
        return None


def outermost(selector: CompiledSelector, model, *, walk: Walk | None = None) -> list[tuple[str, object]]:
    """The modules `selector` matches that lie inside no other match (compile units), in walk order.

    `walk` is the tree's `(path, module)` pairs when the caller already has them (see `walk_modules`).
    """
    units: list[tuple[str, object]] = []
    for path, module in walk_modules(model) if walk is None else walk:
        # a pre-order walk leaves a subtree before it meets the next match: only the last unit can hold `path`
        if selector.matches_module(path, module) and not (units and within(path, units[-1][0])):
            units.append((path, module))
    return units


def walk_modules(model) -> list[tuple[str, object]]:
    """`list(model.named_modules())`, without a generator per level: pre-order, each module once."""
    found = []
    seen = set()
    stack = [("", model)]
    while stack:
        path, module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        found.append((path, module))
        children = module._modules
        if children:
            prefix = path + "." if path else ""
            stack.extend([(prefix + name, child) for name, child in reversed(children.items()) if child is not None])
    return found


def _glob_specificity(glob: str) -> Specificity:
    return (EXACT_PATH, 0) if is_exact_path(glob) else (GLOB_PATH, glob_literal_segments(glob))
