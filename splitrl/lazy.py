"""A package's names that load with their modules on first use (PEP 562): importing the package stays light."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_getattr(package: str, names: Mapping[str, str], space: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` (``space``: its globals) for ``names`` (name -> its submodule):
    the submodule is imported when a name is first asked for, and the name kept in ``space``."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        space[name] = value
        return value

    return __getattr__
