"""Package surfaces that import their modules when a name is first used (PEP 562).

Every package ``__init__`` of paramserve names its public surface here instead of importing it:
importing a package must load neither torch nor grpc (the container health probe and ``--help``
start in milliseconds), and a process that needs one name must not pay for its siblings.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # not typing's: importing typing costs the health probe ~25 ms of CPU
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, homes: Mapping[str, str], modules: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each public name to the module
    that defines it, ``modules`` each public name that is a module itself to that module, both
    relative to ``package`` or absolute (``paramserve....``). Raises AttributeError for any other
    name."""
    submodules = dict(modules or {})
    namespace = importlib.import_module(package).__dict__

    def attribute(name: str) -> Any:
        home = homes.get(name, submodules.get(name))
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home if home.startswith("paramserve.") else f"{package}.{home}")
        value = module if name in submodules else getattr(module, name)
        namespace[name] = value
        return value

    return attribute
