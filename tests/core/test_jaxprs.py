"""core.jaxprs: the def-use facts of a region (DefUse), and rewrite_jaxpr reading a plan made on them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, Literal, jaxpr_as_fun

from replicator.core.context import ReplicaContext
from replicator.core.jaxprs import DefUse, inline_function, rewrite_jaxpr

V = np.arange(3, dtype=np.float32)


def _names(jaxpr):
    return [e.primitive.name for e in jaxpr.eqns]


def _graph():
    """``a`` read twice and returned twice; a literal; a dropped result; an input never read."""

    def f(x, y, z):
        a = jnp.sin(x)  # 0
        b = a * 2.0  # 1: a literal operand
        s, _ = lax.sort((b, y), num_keys=1)  # 2: its second result is dropped
        c = s + a  # 3
        return c, a, a

    jaxpr = jax.make_jaxpr(f)(V, V, V).jaxpr
    assert _names(jaxpr) == ["sin", "mul", "sort", "add"]
    sort = jaxpr.eqns[2]
    dropped = DropVar(sort.outvars[1].aval)  # whether or not make_jaxpr dropped it already
    eqns = [*jaxpr.eqns[:2], sort.replace(outvars=[sort.outvars[0], dropped]), jaxpr.eqns[3]]
    return jaxpr.replace(eqns=eqns)


class TestFacts:
    def test_producers_readers_outputs(self):
        jaxpr = _graph()
        facts = DefUse(jaxpr)
        x, y, z = jaxpr.invars
        (a,), (b,), (s, _), (c,) = (e.outvars for e in jaxpr.eqns)
        assert [facts.producer(v) for v in (a, b, s, c)] == [0, 1, 2, 3]
        assert facts.producer_eqn(s) is jaxpr.eqns[2]
        assert facts.readers(a) == (1, 3) and facts.readers(b) == (2,) and facts.readers(c) == ()
        assert facts.output_positions(a) == (1, 2) and facts.output_positions(c) == (0,)
        assert facts.is_output(a) and facts.is_output(c) and not facts.is_output(b)
        assert facts.is_used(b) and facts.is_used(c) and not facts.is_used(z)

    def test_inputs_have_no_producer_and_an_unread_input_no_readers(self):
        jaxpr = _graph()
        facts = DefUse(jaxpr)
        x, y, z = jaxpr.invars
        assert [facts.producer(v) for v in (x, y, z)] == [None, None, None]
        assert facts.producer_eqn(x) is None
        assert all(facts.is_input(v) for v in (x, y, z))
        assert not facts.is_input(jaxpr.eqns[0].outvars[0])
        assert facts.readers(x) == (0,) and facts.readers(y) == (2,) and facts.readers(z) == ()
        assert not facts.is_used(z) and not facts.is_output(z)

    def test_literals_and_dropped_results_are_not_variables(self):
        jaxpr = _graph()
        facts = DefUse(jaxpr)
        literal = jaxpr.eqns[1].invars[1]
        dropped = jaxpr.eqns[2].outvars[1]
        assert isinstance(literal, Literal) and isinstance(dropped, DropVar)
        for atom in (literal, dropped):
            assert facts.producer(atom) is None and facts.producer_eqn(atom) is None
            assert facts.readers(atom) == () and facts.output_positions(atom) == ()
            assert not facts.is_output(atom) and not facts.is_input(atom) and not facts.is_used(atom)

    def test_an_equation_reading_a_variable_twice_is_one_reader(self):
        jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * jnp.sin(x) + x)(V).jaxpr
        facts = DefUse(jaxpr)
        assert _names(jaxpr) == ["sin", "sin", "mul", "add"]
        mul = jaxpr.eqns[2]
        for var in mul.invars:
            assert facts.readers(var) == (2,)
        square = jax.make_jaxpr(lambda x: x * x)(V).jaxpr
        assert DefUse(square).readers(square.invars[0]) == (0,)

    def test_live_after_is_what_crosses_a_cut(self):
        jaxpr = _graph()
        facts = DefUse(jaxpr)
        x, y, z = jaxpr.invars
        (a,), (b,), (s, _), (c,) = (e.outvars for e in jaxpr.eqns)
        assert facts.live_after(-1) == (x, y)  # z is never read
        assert facts.live_after(0) == (y, a)
        assert facts.live_after(1) == (y, a, b)
        assert facts.live_after(2) == (a, s)
        assert facts.live_after(3) == (a, c)  # what the region returns, in definition order

    @pytest.mark.parametrize("index", [-2, 4])
    def test_live_after_outside_the_region_says_which_indices_exist(self, index):
        with pytest.raises(IndexError, match=r"4 equations; pass -1 to 3"):
            DefUse(_graph()).live_after(index)

    def test_an_input_returned_as_it_is_crosses_every_cut(self):
        jaxpr = jax.make_jaxpr(lambda x: (jnp.sin(x), x))(V).jaxpr
        x = jaxpr.invars[0]
        assert DefUse(jaxpr).live_after(0) == (x, jaxpr.eqns[0].outvars[0])

    def test_constants_are_inputs(self):
        table = np.arange(6, dtype=np.float32).reshape(2, 3)  # captured: a constvar
        jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) + table[0] * table[1])(V).jaxpr
        facts = DefUse(jaxpr)
        (const,), (x,) = jaxpr.constvars, jaxpr.invars
        assert facts.is_input(const) and facts.producer(const) is None and facts.readers(const)
        assert facts.live_after(-1) == (const, x)

    def test_facts_are_for_one_region(self):
        def f(p, x):
            return lax.cond(p, lambda v: jnp.sin(v) + 1.0, lambda v: v, x)

        jaxpr = jax.make_jaxpr(f)(True, V).jaxpr
        (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
        x = jaxpr.invars[1]
        outer = DefUse(jaxpr)
        # The cond reads x for its branches; what the branches do with it is theirs.
        assert outer.readers(x) == (jaxpr.eqns.index(cond),)
        branch = cond.params["branches"][1].jaxpr
        inner = DefUse(branch)
        (v,) = branch.invars
        assert inner.is_input(v) and inner.readers(v) == (0,) and inner.producer(v) is None
        assert inner.producer(x) is None and inner.readers(x) == ()  # another region's variable
        assert outer.producer(branch.eqns[0].outvars[0]) is None

    def test_dead_eqns_keep_effects_and_what_they_read(self):
        def g(x):
            a = jnp.sin(x)  # 0: read only by the callback
            d = jnp.cos(a)  # 1: read only by dead code
            d * 3.0  # 2: result unused
            jax.debug.callback(lambda u: None, a)  # 3: effects
            return x

        jaxpr = jax.make_jaxpr(g)(V).jaxpr
        assert _names(jaxpr) == ["sin", "cos", "mul", "debug_callback"]
        assert DefUse(jaxpr).dead_eqns() == {1, 2}

    def test_dead_eqns_keep_what_is_returned_and_what_it_needs(self):
        assert DefUse(_graph()).dead_eqns() == set()
        jaxpr = jax.make_jaxpr(lambda x: (jnp.sin(x), jnp.cos(x) * 2.0)[0])(V).jaxpr
        assert _names(jaxpr) == ["sin", "cos", "mul"] and DefUse(jaxpr).dead_eqns() == {1, 2}


class TestRewriteWithAPlan:
    """A rule that replaces several equations from a plan made on the graph before the rewrite."""

    def test_new_equations_read_an_earlier_replacement(self):
        # a = sin x; b = cos a; c = b + a. Plan on the original: a -> x + 1, b -> 2 * a
        # (reading the original a, which the rewrite has replaced by then).
        jaxpr = jax.make_jaxpr(lambda x: (lambda a: jnp.cos(a) + a)(jnp.sin(x)))(V).jaxpr
        assert _names(jaxpr) == ["sin", "cos", "add"]
        facts = DefUse(jaxpr)
        (x,), (a,), (b,) = jaxpr.invars, jaxpr.eqns[0].outvars, jaxpr.eqns[1].outvars
        assert facts.producer(a) == 0 and facts.readers(a) == (1, 2)
        ctx = ReplicaContext(1, 1)
        plan = {a: (lambda v: v + 1.0, x), b: (lambda v: v * 2.0, a)}

        def rule(eqn):
            if eqn.outvars[0] not in plan:
                return None
            fn, operand = plan[eqn.outvars[0]]
            return inline_function(fn, [operand], context=ctx)

        new, changed = rewrite_jaxpr(jaxpr, rule)
        assert changed
        defined = set(new.invars) | {v for e in new.eqns for v in e.outvars}
        assert all(v in defined for e in new.eqns for v in e.invars if not isinstance(v, Literal))
        got = jaxpr_as_fun(ClosedJaxpr(new, []))(V)[0]
        np.testing.assert_allclose(got, 2 * (V + 1) + (V + 1), rtol=1e-6)

    def test_out_atoms_read_an_earlier_replacement(self):
        # a = sin x; b = cos a. Plan: a -> x + 1; b stands for a itself (the original a).
        jaxpr = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(V).jaxpr
        (x,), (a,), (b,) = jaxpr.invars, jaxpr.eqns[0].outvars, jaxpr.eqns[1].outvars
        ctx = ReplicaContext(1, 1)

        def rule(eqn):
            if eqn.outvars[0] is a:
                return inline_function(lambda v: v + 1.0, [x], context=ctx)
            if eqn.outvars[0] is b:
                return [], [a]
            return None

        new, _ = rewrite_jaxpr(jaxpr, rule)
        got = jaxpr_as_fun(ClosedJaxpr(new, []))(V)[0]
        np.testing.assert_allclose(got, V + 1, rtol=1e-6)

    def test_a_plan_keyed_by_results_reaches_sub_jaxprs(self):
        # The rule is shown the equations of a jit body with their original results too.
        jaxpr = jax.make_jaxpr(lambda x: jax.jit(lambda v: jnp.cos(jnp.sin(v)))(x) * 2.0)(V).jaxpr
        (call,) = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
        body = call.params["jaxpr"].jaxpr
        facts = DefUse(body)
        (a,) = body.eqns[0].outvars
        (cos,) = [body.eqns[i] for i in facts.readers(a)]
        plan = {cos.outvars[0]: a}  # cos(a) -> a

        def rule(eqn):
            return ([], [plan[eqn.outvars[0]]]) if eqn.outvars and eqn.outvars[0] in plan else None

        new, changed = rewrite_jaxpr(jaxpr, rule)
        assert changed
        got = jaxpr_as_fun(ClosedJaxpr(new, []))(V)[0]
        np.testing.assert_allclose(got, np.sin(V) * 2, rtol=1e-6)
