"""Package namespaces whose names are imported on first use (PEP 562 ``__getattr__``).

``python -m trainkit.launch`` imports ``trainkit`` and ``trainkit.distributed`` before its own
module: with their names imported eagerly, the launcher imported JAX, Flax and orbax (about
2.5 s of CPU) only to start the processes that import them again. Both packages name what they
export in a table; the type checker reads the same names from an ``if TYPE_CHECKING:`` block.

>>> import types
>>> space = types.ModuleType("space")
>>> space.__getattr__ = lazy_attributes(vars(space), {"dumps": ("json", "dumps"), "js": ("json", None)})
>>> space.dumps([1]), space.js.__name__, "dumps" in vars(space)
('[1]', 'json', True)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(namespace: dict[str, Any], table: dict[str, tuple[str, str | None]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``table``: name -> (module, its attribute; ``None``: the
    module itself). Each name is imported on first use and kept in ``namespace`` (the module's
    globals), so later uses are plain lookups."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        module_name, attribute = table[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else vars(module)[attribute]
        namespace[name] = value
        return value

    return __getattr__
