"""Every fix torchfix knows: each module of this package whose name does not start with "_" defines one, ``FIX``.

``ALL`` lists them in the order they apply (and revert in reverse): by ``Fix.order``, then by name. A new fix is a
new module here; nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil

from .._fix import Fix


def _discover() -> dict[str, Fix]:
    """Each fix module's ``FIX``, keyed by the module's name."""
    found = {
        f"{__name__}.{module.name}": importlib.import_module(f"{__name__}.{module.name}").FIX
        for module in pkgutil.iter_modules(__path__)
        if not module.name.startswith("_")
    }
    return dict(sorted(found.items(), key=lambda item: (item[1].order, item[1].name)))


_BY_MODULE = _discover()
ALL: list[Fix] = list(_BY_MODULE.values())
MODULE_OF: dict[str, str] = {fix.name: module for module, fix in _BY_MODULE.items()}  # "fx-tracing-flag" -> its module
