"""The one module that reaches into JAX internals (``jax._src``).

Everything version-specific lives here so that a JAX upgrade breaks in one
place, loudly. Each helper names the public API it stands in for, if any.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Any

from jax._src import source_info_util as _source_info_util
from jax._src import xla_bridge as _xla_bridge

UNKNOWN_LOCATION = "<unknown location>"

__all__ = [
    "UNKNOWN_LOCATION",
    "backends_initialized",
    "callback_function",
    "custom_vmap_call_primitive",
    "exclude_from_user_frames",
    "extend_axis_env",
    "extra_call_params",
    "fast_compile_xla_flags",
    "jit_inlined_by_jax",
    "named_axis_effect_type",
    "reduce_scatter_primitive",
    "scan_operand_counts",
    "stage_as_one_call",
    "with_leading_inputs",
    "user_source_line",
    "with_fast_compile_flags",
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


def _library_dirs() -> tuple[str, ...]:
    """Where library code lives: installed packages, the standard library and replicator itself."""
    dirs = {os.path.dirname(os.path.abspath(__file__))}  # replicator/
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path))
    return tuple(sorted(dirs))


def _is_library(file_name: str) -> bool:
    if file_name.startswith("<") or "site-packages" in file_name or "dist-packages" in file_name:
        return True
    path = os.path.abspath(file_name)
    return any(path == d or path.startswith(d + os.sep) for d in _library_dirs())


def user_code_line(source_info: Any) -> str:
    """``file:line (function)`` of the innermost frame in the user's own code that made an equation.

    JAX's own frames are skipped by :func:`user_source_line`; this also skips
    installed libraries (Flax, Optax, ...), the standard library and replicator,
    so that an update made inside ``nn.BatchNorm`` (or a loop made by Flax's
    ``nn.scan``) names the user's line that called it. Falls back to
    :func:`user_source_line`.
    """
    try:
        frames = source_info.traceback.frames  # innermost first
    except AttributeError:
        frames = []
    for frame in frames:
        if not _is_library(frame.file_name):
            return f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
    return user_source_line(source_info)


def source_of(eqn: Any) -> Any:
    """A context in which new equations carry ``eqn``'s source (its traceback and name stack), so that
    a graph traced again from another keeps the user's lines (``replicator.tensor.split_graph``).

    Nested in the context of the call that holds ``eqn`` (a ``jit``'s body walked inline), the name stack
    is the call's and then ``eqn``'s own, which is relative to it: the ``transpose`` of a jitted function's
    backward stays on its equations (what a pipeline's stage split reads, ``stages/split.py``); and an
    equation whose traceback has no frame of the user's (a cached body of ``jnp.where``) keeps the call's."""
    info, current = eqn.source_info, _source_info_util.current()
    traceback = info.traceback
    if _source_info_util.user_frame(traceback) is None and current.traceback is not None:
        traceback = current.traceback
    return _source_info_util.user_context(traceback, name_stack=current.name_stack + info.name_stack)


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


def scan_operand_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    JAX 0.10 stores both as integer params; 0.12 stores the operand structure as
    flat trees ``ft_in = (consts, carry, xs)``. The body's inputs are ordered
    consts, carry, xs and its outputs carry, ys in both.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def jit_inlined_by_jax(params: dict) -> bool:
    """Whether a ``jit`` equation's author asked for it to be inlined (``jax.jit(f, inline=True)``).

    JAX 0.10 inlined such calls while tracing (they never reach a jaxpr) and
    stores ``inline`` as a bool; 0.11+ keeps them in the jaxpr with
    ``inline=Inline.JAX_LATE`` (``True``) or ``Inline.JAX_EARLY``.
    """
    inline = params.get("inline", False)
    if isinstance(inline, bool):
        return inline
    return getattr(inline, "name", "") in ("JAX_EARLY", "JAX_LATE")


def fast_compile_xla_flags() -> list[str]:
    """XLA flags that trade the compiled code's speed for compile time (tests, the fuzzer).

    ``--xla_cpu_use_fusion_emitters`` exists in the XLA of jaxlib 0.10 but not in
    0.11+, where an unknown flag aborts the process: the list depends on the
    installed jaxlib, read without starting JAX's backend.
    """
    flags = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    if _jaxlib_version() < (0, 11):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return flags


def with_fast_compile_flags(xla_flags: str) -> str:
    """``xla_flags`` with :func:`fast_compile_xla_flags` added where it does not set them already.

    >>> with_fast_compile_flags("--xla_backend_optimization_level=2").split()[0]
    '--xla_llvm_disable_expensive_passes=true'
    """
    given = {f.split("=")[0] for f in xla_flags.split()}
    fast = [f for f in fast_compile_xla_flags() if f.split("=")[0] not in given]
    return " ".join([*fast, *xla_flags.split()])


def _jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(part) for part in version("jaxlib").split(".")[:2])


def extra_call_params() -> dict[str, str]:
    """Call-like primitives (by name) that only some JAX versions have, and their callee param.

    In JAX 0.12 ``closed_call_p`` and ``call_p`` are one primitive named
    ``eval_jaxpr`` (callee in ``call_jaxpr``); 0.10 names them ``closed_call`` and
    ``call``. Listing a name that this JAX lacks is harmless: no equation has it.
    """
    return {"eval_jaxpr": "call_jaxpr"}


def stage_as_one_call(jaxpr: Any, name: str) -> Any:
    """``f(*args)``: ``jaxpr`` (without constvars) applied to ``args``, staged into the enclosing trace as
    *one* ``jit`` equation, as calling a ``jax.jit`` function there records.

    Stands in for ``jax.extend.core.jaxpr_as_fun``, which binds every equation again: for a step of
    thousands of equations that second trace cost as much as tracing the user's step (about 0.13 s
    on the 64-layer MLP of ``benchmarks/first_call.py``). The equation's parameters are those JAX
    gives a plain ``jax.jit`` call in the same context (read from a one-equation trace, so they
    follow the JAX version: ``jaxpr`` is a ``ClosedJaxpr`` in 0.10 and a ``Jaxpr`` holding its
    constants in 0.12), widened to this jaxpr's inputs and outputs.
    """
    import jax
    import numpy as np
    from jax.extend.core import ClosedJaxpr

    closed = ClosedJaxpr(jaxpr, [])
    n_in, n_out = len(jaxpr.invars), len(jaxpr.outvars)

    def call(*args: Any) -> list:
        (template,) = jax.make_jaxpr(jax.jit(lambda x: x * 2))(np.float32(0)).jaxpr.eqns
        params = dict(template.params)
        params.update(
            jaxpr=closed,
            in_shardings=params["in_shardings"][:1] * n_in,
            out_shardings=params["out_shardings"][:1] * n_out,
            in_layouts=(None,) * n_in,
            out_layouts=(None,) * n_out,
            donated_invars=(False,) * n_in,
            name=name,
            keep_unused=True,
        )
        return template.primitive.bind(*args, **params)

    return call


def with_leading_inputs(jaxpr: Any, leading: list) -> Any:
    """``jaxpr`` taking its constvars, in the order of ``leading`` (all of them), as its first inputs.

    Its debug info (argument names, one per input) is widened to match.
    """
    assert set(leading) == set(jaxpr.constvars) and len(leading) == len(jaxpr.constvars)
    info = jaxpr.debug_info
    if info is not None and info.arg_names is not None:
        info = info._replace(arg_names=(*(f"constant {k}" for k in range(len(leading))), *info.arg_names))
    return jaxpr.replace(constvars=[], invars=[*leading, *jaxpr.invars], debug_info=info)
