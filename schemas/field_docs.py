"""Each policy field's description: the docstring written under it in `policy.py`.

Read from the source when asked (the JSON Schema export, the nodes' tooltips) rather than by pydantic at class
creation (`use_attribute_docstrings`), which looks for a class's source by searching every loaded module: 80 ms of
each import of Streamwise after torch and transformers, paid by every load."""

from __future__ import annotations

import ast
import functools
import inspect
import sys

from pydantic import BaseModel


def field_descriptions(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> its docstring, from the nearest class in `model`'s MRO that documents it."""
    documented: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if issubclass(cls, BaseModel) and cls is not BaseModel:
            documented.update(_class_docstrings(cls.__module__).get(cls.__qualname__, {}))
    return {name: documented[name] for name in model.model_fields if name in documented}


@functools.cache
def _class_docstrings(module: str) -> dict[str, dict[str, str]]:
    """Per top-level class of `module`: the string literal right after each of its annotated attributes."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    return {
        node.name: {
            statement.target.id: inspect.cleandoc(following.value.value)
            for statement, following in zip(node.body, node.body[1:], strict=False)
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        }
        for node in tree.body if isinstance(node, ast.ClassDef)
    }
