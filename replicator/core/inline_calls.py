"""Inline the ``jit`` calls that their author marked ``inline=True``.

JAX 0.10 inlined ``jax.jit(f, inline=True)`` while tracing, so the step graph
held ``f``'s equations. JAX 0.11 made ``inline=True`` mean ``Inline.JAX_LATE``:
the call stays in the jaxpr and is inlined only when lowering to MLIR. Optax
marks its small helpers so (Adam's ``tree_bias_correction``), and passes that
match patterns in the top-level graph (``shard-optimizer-update`` chunks
element-wise updates) would see an opaque call. :func:`inline_marked_calls`,
run on every traced step, gives every supported JAX the same graph.

>>> import functools
>>> double = functools.partial(jax.jit, inline=True)(lambda x: 2 * x)
>>> closed = jax.make_jaxpr(lambda x: double(x) + 1)(1.0)
>>> [e.primitive.name for e in inline_marked_calls(closed.jaxpr).eqns]
['mul', 'add']
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Var

from replicator._jax_compat import jit_inlined_by_jax
from replicator.core.jaxprs import map_subjaxprs

__all__ = ["inline_marked_calls"]


def inline_marked_calls(jaxpr: Jaxpr) -> Jaxpr:
    """``jaxpr`` with every ``jit`` equation marked ``inline`` replaced by its body, recursively.

    Returns ``jaxpr`` itself when there is nothing to inline.
    """
    eqns, env, changed = [], {}, False
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in env for v in eqn.invars):
            eqn = eqn.replace(invars=[_read(env, v) for v in eqn.invars])
        mapped = map_subjaxprs(eqn, inline_marked_calls)
        changed |= mapped is not eqn
        eqn = mapped
        body = _inlinable_body(eqn)
        if body is None:
            eqns.append(eqn)
            continue
        changed = True
        body = inline_marked_calls(body)
        inner_env: dict[Var, Any] = dict(zip(body.invars, eqn.invars, strict=True))
        for inner in body.eqns:
            outvars = []
            for v in inner.outvars:
                if isinstance(v, DropVar):
                    outvars.append(v)
                else:
                    inner_env[v] = fresh = Var(v.aval)  # a body may be inlined twice: fresh names
                    outvars.append(fresh)
            eqns.append(inner.replace(invars=[_read(inner_env, v) for v in inner.invars], outvars=outvars))
        for var, atom in zip(eqn.outvars, body.outvars, strict=True):
            if not isinstance(var, DropVar):
                env[var] = _read(inner_env, atom)
    if not changed:
        return jaxpr
    return jaxpr.replace(eqns=eqns, outvars=[_read(env, v) for v in jaxpr.outvars])


def _read(env: dict[Var, Any], atom: Any) -> Any:
    return env.get(atom, atom) if isinstance(atom, Var) else atom


def _inlinable_body(eqn: JaxprEqn) -> Jaxpr | None:
    if eqn.primitive.name != "jit" or not jit_inlined_by_jax(eqn.params):
        return None
    body = eqn.params["jaxpr"]
    if isinstance(body, ClosedJaxpr):
        if body.consts:  # not seen from JAX; keep the call rather than guess
            return None
        body = body.jaxpr
    return body if not body.constvars else None
