"""Packages whose names are imported on first use (PEP 562), so that reading a job file,
which needs a constant or two of a package, does not load SciPy with the rest of it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The package's module ``__getattr__``: ``where`` maps each exported name to the module
    that defines it, which is imported (and the name kept) when the name is first read."""
    modules = {module.rsplit(".", 1)[1] for module in where.values()}
    if clash := sorted(modules & set(where)):  # importing that submodule would shadow the name
        raise ImportError(f"{package}: lazily exported names shadowed by submodules: {clash}")
    namespace = importlib.import_module(package).__dict__

    def attribute(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    return attribute
