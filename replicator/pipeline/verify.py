"""Deprecated: now :mod:`replicator.pass_manager.verify`; each name taken from here warns ``DeprecationWarning``."""

from typing import Any

from replicator.pipeline import moved, old_all

__all__ = old_all(__name__)  # `from ... import *` takes each, with its warning


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # a tool asking for __wrapped__ and the like: not a moved name
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return moved(__name__, name)
