"""Matching selectors against modules, and how specific each match is.

A module is seen only through its dotted path, the names of its class and the class's bases, and which sorts of
direct tensors it holds (`holds`). Matching therefore needs neither torch nor the module's code, and a policy never
causes an import: class entries are compared by name (or glob). What a selector makes of a class depends on the
class alone, so a `CompiledSelector` decides it once per class; only path globs, regexes and `holds` are tried per
module. `walk_modules` and `outermost` are the tree walks resolve and compile share; `declared_blocks` reads a
tree's own declaration of its repeated blocks, and `found_blocks` finds them in a tree that declares none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from torch import nn

from ...schemas import Selector
from ...schemas.patterns import (
    compile_glob,
    compile_regex,
    glob_literal_segments,
    glob_matches,
    is_class_glob,
    is_exact_path,
)
from ..engine.class_facts import class_fact
from ..engine.protocol import original_class  # a converted module is seen as its original class

# Specificity tiers, highest first (see the README's precedence table).
EXACT_PATH, GLOB_PATH, REGEX, CLASS, HOLDS = 4, 3, 2, 1, 0
QUALIFIED_CLASS, SHORT_CLASS, CLASS_GLOB, SUBCLASS = 3, 2, 1, 0

Specificity = tuple[int, int]
class ClassName(NamedTuple):
    """How selectors name one class: `short` (`Linear`) and `qualified` (`torch.nn.modules.linear.Linear`)."""

    short: str
    qualified: str


ClassNames = tuple[ClassName, ...]  # per class of an MRO, the class itself first
T = TypeVar("T")
Walk = Iterable[tuple[str, object]]  # (path, module) pairs in `named_modules()` order


@class_fact
def class_names(cls: type) -> ClassNames:
    """The names selectors compare for instances of `cls` (its original class's MRO, without `object`): every
    selector and section asks on first sight of a class."""
    return tuple(ClassName(c.__name__, f"{c.__module__}.{c.__qualname__}") for c in original_class(cls).__mro__[:-1])


class PerClass(dict, Generic[T]):
    """`compute(cls)` per class, worked out on first sight of the class (`cache[type(module)]`)."""

    def __init__(self, compute: Callable[[type], T]) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, cls: type) -> T:
        value = self[cls] = self.compute(cls)
        return value


def holds(module: object) -> str | None:
    """What `holds` entries see of a module: `parameters`, `buffers-only`, or None (no direct tensors)."""
    if any(tensor is not None for tensor in vars(module).get("_parameters", {}).values()):
        return "parameters"
    if any(tensor is not None for tensor in vars(module).get("_buffers", {}).values()):
        return "buffers-only"
    return None


@dataclass(frozen=True)
class ModuleRef:
    """A module as selectors see it: its path, the names of the classes in its MRO, and what it holds."""

    path: str
    classes: ClassNames
    holds: str | None = None

    @classmethod
    def of(cls, path: str, module: object) -> ModuleRef:
        return cls(path, class_names(type(module)), holds(module))

    @property
    def name(self) -> str:
        """The short class name (`Linear`)."""
        return self.classes[0].short

    @property
    def qualname(self) -> str:
        """The qualified class name (`torch.nn.modules.linear.Linear`)."""
        return self.classes[0].qualified


def within(path: str, outer: str) -> bool:
    """Whether the module at `path` lies inside the module at `outer` ("" is the root)."""
    return outer == "" or path.startswith(outer + ".")


class CompiledSelector:
    """A selector with its globs and regexes compiled once and its class verdicts cached per class."""

    def __init__(self, selector: Selector) -> None:
        self.selector = selector
        self._globs = [(compile_glob(g), _glob_specificity(g)) for g in selector.path]
        self._regexes = [compile_regex(r) for r in selector.regex]
        self._classes = frozenset(name for name in selector.class_ if not is_class_glob(name))
        self._class_globs = [(compile_glob(name), "." in name) for name in selector.class_ if is_class_glob(name)]
        self.class_keys = None if self._class_globs or selector.subclasses else self._classes
        """The names a class must go by for this selector to name it (None: a glob or a base may name any class)."""
        self.holds = selector.holds
        self.by_path = bool(self._globs or self._regexes)
        self.by_module = self.by_path or self.holds is not None
        """Whether a verdict can depend on more than the class (the path, or what the module holds)."""
        self.of_class: PerClass[Specificity | None] = PerClass(lambda cls: self.class_specificity(class_names(cls)))
        """`class_specificity` for instances of a class, decided once per class: `of_class[cls]`."""

    def specificity(self, module: ModuleRef) -> Specificity | None:
        """How specifically this selector names `module`, or None when it does not match it."""
        return (self.path_specificity(module.path) or self.class_specificity(module.classes)
                or self.holds_specificity(module.holds))

    def matches(self, module: ModuleRef) -> bool:
        return self.specificity(module) is not None

    def matches_module(self, path: str, module: object) -> bool:
        """`matches`, for a live module: its class verdict is cached."""
        if self.of_class[type(module)] is not None:
            return True
        return self.by_module and self.module_specificity(path, module) is not None

    def module_specificity(self, path: str, module: object) -> Specificity | None:
        """The part of the verdict that depends on more than the class: the path, then what the module holds."""
        return self.path_specificity(path) or (self.holds_specificity(holds(module)) if self.holds else None)

    def holds_specificity(self, held: str | None) -> Specificity | None:
        return (HOLDS, 0) if self.holds is not None and held == self.holds else None

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
        """Qualified name > short name > a class glob > a base's name or glob (with `subclasses`), or None."""
        if not (self._classes or self._class_globs):
            return None
        (short, qualified), *bases = classes
        if qualified in self._classes:
            return (CLASS, QUALIFIED_CLASS)
        if short in self._classes:
            return (CLASS, SHORT_CLASS)
        if self._glob_names(short, qualified):
            return (CLASS, CLASS_GLOB)
        if self.selector.subclasses and any(s in self._classes or q in self._classes or self._glob_names(s, q)
                                            for s, q in bases):
            return (CLASS, SUBCLASS)
        return None

    def _glob_names(self, short: str, qualified: str) -> bool:
        """Whether a class glob matches the class: a glob with a `.` against the qualified name, else the short."""
        return any(glob_matches(pattern, qualified if dotted else short) for pattern, dotted in self._class_globs)


def outermost(selector: CompiledSelector, model, *, walk: Walk | None = None) -> list[tuple[str, object]]:
    """The modules `selector` matches that lie inside no other match (compile units), in walk order.

    `walk` is the tree's `(path, module)` pairs when the caller already has them (see `walk_modules`). A selector
    with `no_split` also matches the classes the tree declares as its blocks (`declared_blocks`).
    """
    walk = walk_modules(model) if walk is None else walk
    declared = declared_blocks(walk) if getattr(selector.selector, "no_split", False) else frozenset()
    units: list[tuple[str, object]] = []
    for path, module in walk:
        # a pre-order walk leaves a subtree before it meets the next match: only the last unit can hold `path`
        matches = selector.matches_module(path, module) or class_names(type(module))[0].short in declared
        if matches and not (units and within(path, units[-1][0])):
            units.append((path, module))
    return units


NO_SPLIT = ("_no_split_modules",)
"""transformers' (and accelerate's) declaration of a tree's repeated blocks: what `no_split = true` selects."""
REPEATED = (*NO_SPLIT, "_repeated_blocks")
"""Every declaration of a tree's repeated blocks: diffusers also lists them in `_repeated_blocks` (the classes its
`compile_repeated_blocks` compiles), the only declaration some of its models make (LTX-Video)."""


def declared_blocks(walk: Walk, attributes: tuple[str, ...] = NO_SPLIT) -> frozenset[str]:
    """The class names a tree declares as its repeated blocks: every `_no_split_modules` of its modules (set on an
    instance when it is built, else on its class), or every list named in `attributes` (`REPEATED`: diffusers'
    `_repeated_blocks` too).

    Read from the instances' and the classes' own dictionaries, as data: nothing is called, imported or evaluated.
    """
    declared: set[str] = set()
    for attribute in attributes:
        classes = set()
        for _, module in walk:
            names = vars(module).get(attribute)
            if names is None:
                classes.add(type(module))
            declared.update(_names(names))
        for cls in classes:
            for klass in original_class(cls).__mro__:
                names = vars(klass).get(attribute)
                if names is not None:
                    declared.update(_names(names))
                    break
    return frozenset(declared)


def found_blocks(walk: Walk) -> list[str]:
    """The paths of a tree's repeated blocks where nothing declares them: the children of its largest `ModuleList`
    or `Sequential` (by the bytes of the parameters below it) whose children, at least 2, are all of one class
    (timm's ViT `blocks`, open_clip's `resblocks`); [] when there is none. A `Sequential` of mixed layers (an MLP)
    is not repeated.

    Bytes are summed in one pass over the walk, each module's direct parameters counted for every container above it.
    """
    walk = list(walk)
    below: dict[str, int] = {}  # the bytes of the parameters in each module's subtree, by path
    for path, module in reversed(walk):  # pre-order reversed: every child is counted before its parent
        size = below.get(path, 0) + sum(p.nbytes for p in vars(module).get("_parameters", {}).values()
                                        if p is not None)
        below[path] = size
        if path:
            parent = path.rpartition(".")[0]
            below[parent] = below.get(parent, 0) + size
    best, largest = None, 0
    for path, module in walk:
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or below[path] <= largest:
            continue
        children = [child for child in module._modules.values() if child is not None]
        if len(children) >= 2 and len({class_names(type(child))[0].qualified for child in children}) == 1:
            best, largest = (path, module), below[path]
    if best is None:
        return []
    path, module = best
    return [joined(path, name) for name, child in module._modules.items() if child is not None]


def _names(value: object) -> list[str]:
    return [name for name in value if isinstance(name, str)] if isinstance(value, (list, tuple, set, frozenset)) else []


def walk_modules(model) -> list[tuple[str, object]]:
    """`list(model.named_modules())`, without a generator per level: pre-order, each module once."""
    found = []
    seen = set()
    stack = [("", model)]
    while stack:
        entry = stack.pop()
        path, module = entry
        if module in seen:
            continue
        seen.add(module)
        found.append(entry)
        children = module._modules
        if children:
            prefix = path + "." if path else ""
            stack.extend([(prefix + name, child) for name, child in reversed(children.items()) if child is not None])
    return found


def joined(path: str, name: str) -> str:
    """The path of `name` (a child, parameter or buffer) of the module at `path` (`""`: the root)."""
    return f"{path}.{name}" if path else name


def _glob_specificity(glob: str) -> Specificity:
    return (EXACT_PATH, 0) if is_exact_path(glob) else (GLOB_PATH, glob_literal_segments(glob))
