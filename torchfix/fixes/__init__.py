"""Every fix torchfix knows: each module of this package whose name does not start with "_" defines one, ``FIX``.

``ALL`` lists them in the order they apply (and revert in reverse): by ``Fix.order``, then by name. A new fix is a
new module here; nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil

from .._fix import Fix


def _discover() -> list[Fix]:
    found = [
        importlib.import_module(f"{__name__}.{module.name}").FIX
        for module in pkgutil.iter_modules(__path__)
        if not module.name.startswith("_")
    ]
    return sorted(found, key=lambda fix: (fix.order, fix.name))


ALL: list[Fix] = _discover()
