"""Lazy package exports (layer 1): a package's public names, imported on first use.

``import fullshard.app.cli`` runs ``fullshard/__init__.py`` first; importing the engine, DTensor
and ``torch.distributed.checkpoint`` there cost the launcher (which needs none of them) over a
second per launch. The package ``__init__`` files name where each public name lives and import
it on first access (PEP 562), with the real imports under ``TYPE_CHECKING`` for type checkers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    package: str,
    namespace: dict[str, Any],
    sources: Mapping[str, str],
    *,
    submodules: Iterable[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose globals are ``namespace``.

    ``sources`` maps each public name to the module that defines it; ``submodules`` are
    subpackages reachable as attributes (``fullshard.engine``). A name loaded once is cached in
    ``namespace``. Unknown names raise ``AttributeError``, so ``from package import submodule``
    still falls back to importing the submodule.
    """
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is not None:
            value = getattr(importlib.import_module(source), name)
        elif name in subs:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
