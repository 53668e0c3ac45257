"""Calls marked ``jax.jit(..., inline=True)`` are inlined at trace time on every JAX version."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import jaxpr_as_fun

from replicator.core.inline_calls import inline_marked_calls
from replicator.passes import count_primitives

inline_jit = functools.partial(jax.jit, inline=True)


@inline_jit
def _scale(x, s):
    return x * s


@inline_jit
def _twice_scaled(x):
    return _scale(x, 2.0) + _scale(x, 3.0)  # the same body inlined twice, nested


@jax.jit
def _kept(x):
    return jnp.sin(x)


def _step(x):
    y = _twice_scaled(x) + _kept(x)
    return jax.lax.scan(lambda c, v: (c + _twice_scaled(v), c), jnp.zeros(x.shape[1:]), y)


def test_marked_calls_are_inlined_recursively_and_plain_jit_is_kept():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    closed = jax.make_jaxpr(_step)(x)
    inlined = inline_marked_calls(closed.jaxpr)
    # Before: the marked calls are there on JAX >= 0.11 (and already gone on 0.10).
    assert count_primitives(inlined, ["jit"]) == {"jit": 1}  # only the unmarked _kept
    assert count_primitives(inlined, ["mul"])["mul"] >= 4  # 2 scalings x (top level + scan body)
    got = jaxpr_as_fun(closed.replace(jaxpr=inlined))(x)
    want = jaxpr_as_fun(closed)(x)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_single_assignment_holds_after_inlining_one_body_twice():
    closed = jax.make_jaxpr(_twice_scaled)(np.ones(3, np.float32))
    inlined = inline_marked_calls(closed.jaxpr)
    outvars = [v for e in inlined.eqns for v in e.outvars]
    assert len(outvars) == len(set(outvars))


def test_optax_adam_update_is_element_wise_at_the_top_level():
    # shard-optimizer-update chunks Adam's element-wise update; its bias correction is an inline jit.
    opt = optax.adam(1e-3)
    params = {"w": jnp.ones((16, 4))}

    def update(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    closed = jax.make_jaxpr(update)(params, opt.init(params), params)
    inlined = inline_marked_calls(closed.jaxpr)
    float_jits = [e for e in inlined.eqns if e.primitive.name == "jit" and e.outvars[0].aval.shape]
    assert float_jits == []


def test_nothing_to_inline_returns_the_same_jaxpr():
    closed = jax.make_jaxpr(lambda x: _kept(x) + 1)(1.0)
    assert inline_marked_calls(closed.jaxpr) is closed.jaxpr
