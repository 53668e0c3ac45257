"""Deprecated: the pass infrastructure moved to :mod:`replicator.pass_manager`.

"Pipeline" now means pipeline parallelism only (:mod:`replicator.stages`). The old names
still work and warn ``DeprecationWarning`` naming the new one: ``from replicator.pipeline
import Pipeline`` (now :class:`replicator.pass_manager.manager.PassManager`, ``rp.PassManager``),
and every name of ``replicator.pipeline.contract``, ``.pipeline`` and ``.verify`` (now
``replicator.pass_manager.contract``, ``.manager`` and ``.verify``). The warning comes when a
name is taken from an old module, not when the module is imported: a module is imported once
per process, a name is taken by each caller.
"""

from __future__ import annotations

import importlib
from typing import Any

from replicator.pass_manager.manager import warn_renamed

#: Old module -> its new home.
MOVED_MODULES: dict[str, str] = {
    "replicator.pipeline.contract": "replicator.pass_manager.contract",
    "replicator.pipeline.pipeline": "replicator.pass_manager.manager",
    "replicator.pipeline.verify": "replicator.pass_manager.verify",
}

#: Old name -> new name, where the name itself changed.
RENAMED: dict[str, str] = {"Pipeline": "PassManager", "Stage": "PassSnapshot"}


def moved(old_module: str, name: str, *, stacklevel: int = 3) -> Any:
    """``name`` of the old module ``old_module`` from its new home, with a ``DeprecationWarning``."""
    homes = [MOVED_MODULES[old_module]] if old_module in MOVED_MODULES else list(MOVED_MODULES.values())
    new = RENAMED.get(name, name)
    for home in homes:
        module = importlib.import_module(home)
        if hasattr(module, new):
            warn_renamed(
                f"{old_module}.{name} is now {home}.{new}"
                + (" (rp.PassManager)" if new == "PassManager" else "")
                + ": 'pipeline' now means pipeline parallelism only; import it from its new module.",
                stacklevel=stacklevel,
            )
            return getattr(module, new)
    raise AttributeError(f"module {old_module!r} has no attribute {name!r}")


def old_all(old_module: str) -> list[str]:
    """The ``__all__`` of ``old_module`` as it was: its new home's, under the old names."""
    new = {v: k for k, v in RENAMED.items()}
    return [new.get(name, name) for name in importlib.import_module(MOVED_MODULES[old_module]).__all__]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # a tool asking for __wrapped__ and the like: not a moved name
        raise AttributeError(f"module 'replicator.pipeline' has no attribute {name!r}")
    if f"replicator.pipeline.{name}" in MOVED_MODULES:  # `from replicator.pipeline import pipeline`
        return importlib.import_module(f"replicator.pipeline.{name}")
    return moved("replicator.pipeline", name)
