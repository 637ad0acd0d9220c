"""Lazy package exports (PEP 562): a package names what it exports and from which submodule, and imports the
submodule on first use, so `import trainer.data` or `import trainer.models` stays light (no torch) until a name
that needs it is used (the CLI validates options before heavy imports)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: `package.<name>` for a name of `exports` ({name: submodule}) is
    imported from `package.<submodule>` on first use and cached in `namespace` (the package's globals()).
    Raises AttributeError for any other name, as a module does."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value
        return value

    return __getattr__
