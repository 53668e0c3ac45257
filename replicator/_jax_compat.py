"""The one module that reaches into JAX internals (``jax._src``).

Everything version-specific lives here so that a JAX upgrade breaks in one
place, loudly. Each helper names the public API it stands in for, if any.
"""

from __future__ import annotations

import os
from typing import Any

from jax._src import source_info_util as _source_info_util
from jax._src import xla_bridge as _xla_bridge

UNKNOWN_LOCATION = "<unknown location>"

__all__ = [
    "UNKNOWN_LOCATION",
    "backends_initialized",
    "custom_vmap_call_primitive",
    "exclude_from_user_frames",
    "extend_axis_env",
    "user_source_line",
]


def backends_initialized() -> bool:
    """True once JAX has created its backends (after which XLA_FLAGS is fixed)."""
    return bool(getattr(_xla_bridge, "_backends", {}))


def exclude_from_user_frames(path: str) -> None:
    """Hide frames under ``path`` from the source lines JAX records in jaxprs.

    With this, an equation created inside ``replicator`` is attributed to the
    user's line that called into it, which is what error messages should name.
    """
    _source_info_util.register_exclusion(os.path.dirname(path))


def user_source_line(source_info: Any) -> str:
    """``file:line (function)`` of the user's code that created an equation."""
    if source_info is None:
        return UNKNOWN_LOCATION
    frame = _source_info_util.user_frame(source_info.traceback)
    if frame is None:
        return UNKNOWN_LOCATION
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def extend_axis_env(axis_env: list[tuple[str, int]]) -> Any:
    """Bind named mesh axes, as ``shard_map`` does, for checking a jaxpr."""
    from jax._src import core as _core

    return _core.extend_axis_env_nd(axis_env)


def custom_vmap_call_primitive() -> Any:
    """The primitive of ``jax.custom_batching.custom_vmap`` calls (not in ``jax.extend``).

    Returns ``None`` if this JAX has no such primitive.
    """
    try:
        from jax._src.custom_batching import custom_vmap_p
    except ImportError:  # pragma: no cover - depends on the JAX version
        return None
    return custom_vmap_p


def reduce_scatter_primitive() -> Any:
    """``lax.psum_scatter``'s primitive (not exported by ``jax.extend.core.primitives``)."""
    from jax._src.lax import parallel

    return parallel.reduce_scatter_p


def named_axis_effect_type() -> type:
    """The effect JAX attaches to equations that use a named axis (``lax.psum(x, 'batch')``)."""
    from jax._src import core

    return core.NamedAxisEffect


def callback_function(params: dict) -> Any:
    """The user's function of a ``pure_callback`` equation (``None`` if this JAX stores it otherwise)."""
    return getattr(params.get("callback"), "callback_func", None)
