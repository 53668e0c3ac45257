"""Replica-invariance analysis and the check-replica-invariance pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp
from replicator.passes import Pipeline, analyze_invariance

THIS_FILE = __file__.rsplit("/", 1)[-1]


def _batch(n):
    return {"x": np.ones((2 * n, 3), np.float32)}


def _output_variance(repl, fn, state=None):
    lowered = repl.lower(fn, _batch(repl.num_replicas), state)
    info = analyze_invariance(lowered.traced)
    return info.output_variance[lowered.traced.num_state :]


BOTH = frozenset({"workers", "cores"})


class TestAnalysis:
    def test_batch_varies_collectives_make_invariant(self, repl2d):
        outs = _output_variance(
            repl2d,
            lambda b: (
                b["x"],
                rp.all_mean(b["x"]),
                rp.all_sum(b["x"], group="cores"),
                rp.all_max(b["x"], group="workers"),
                rp.all_gather(b["x"]),
                rp.broadcast(b["x"]),
                rp.replica_id(),
                rp.replica_id(group="cores"),
                rp.reduce_scatter(jnp.ones((repl2d.num_replicas, 3)) * rp.all_sum(b["x"]).sum()),
                jnp.float32(rp.num_replicas()),
            ),
        )
        assert outs == (
            BOTH,
            frozenset(),
            frozenset({"workers"}),
            frozenset({"cores"}),
            frozenset(),
            frozenset(),
            BOTH,
            frozenset({"cores"}),
            BOTH,
            frozenset(),
        )

    def test_state_is_invariant_and_mixing_with_batch_varies(self, repl):
        state = {"w": jnp.zeros(3)}
        lowered = repl.lower(
            lambda s, b: (s, {"a": s["w"] * 2, "b": s["w"] * b["x"]}), _batch(repl.num_replicas), state
        )
        info = analyze_invariance(lowered.traced)
        assert info.output_variance == (frozenset(), frozenset(), frozenset({"cores"}))

    def test_size_one_axes_cannot_vary(self, repl):
        # One worker: a collective over 'cores' alone already covers every replica.
        (out,) = _output_variance(repl, lambda b: rp.all_sum(b["x"], group="cores"))
        assert out == frozenset()

    def test_scan_carry_reaches_fixpoint(self, repl):
        def fn(b):
            def body(carry, x):
                a, c = carry
                return (c, x), None  # variance flows from x into c into a over two steps

            (a, c), _ = lax.scan(body, (jnp.zeros(3), jnp.zeros(3)), b["x"])
            return a, rp.all_sum(a)

        assert _output_variance(repl, fn) == (frozenset({"cores"}), frozenset())

    def test_cond_on_varying_predicate_makes_outputs_vary(self, repl):
        (out,) = _output_variance(repl, lambda b: lax.cond(b["x"][0, 0] > 0, lambda: 1.0, lambda: 2.0))
        assert out == frozenset({"cores"})


class TestDivergentControlFlow:
    def test_collective_under_batch_dependent_cond_is_rejected(self, repl):
        def step(b):
            return lax.cond(b["x"].sum() > 0, lambda: rp.all_sum(b["x"]), lambda: b["x"])

        with pytest.raises(rp.DivergentControlFlowError) as err:
            repl.lower(step, _batch(repl.num_replicas))
        msg = str(err.value)
        assert "all_sum" in msg and "lax.cond" in msg and THIS_FILE in msg and "Fix:" in msg

    def test_collective_under_replica_id_while_is_rejected(self, repl):
        def step(b):
            body = lambda c: (c[0] + 1, rp.all_mean(c[1]))  # noqa: E731
            return lax.while_loop(lambda c: c[0] < rp.replica_id(), body, (0, b["x"]))[1]

        with pytest.raises(rp.DivergentControlFlowError, match="all_mean.*lax.while_loop"):
            repl.lower(step, _batch(repl.num_replicas))

    def test_collective_in_nested_jit_inside_cond_is_found(self, repl):
        inner = jax.jit(lambda x: rp.all_max(x))

        def step(b):
            return lax.cond(b["x"][0, 0] > 0, inner, lambda x: x, b["x"])

        with pytest.raises(rp.DivergentControlFlowError, match="all_max"):
            repl.lower(step, _batch(repl.num_replicas))

    def test_collective_passed_directly_as_a_branch_names_the_cond(self, repl):
        def step(b):
            return lax.cond(b["x"][0, 0] > 0, rp.all_mean, lambda x: x, b["x"])

        with pytest.raises(
            rp.DivergentControlFlowError,
            match=rf"all_mean at a branch or body of the lax.cond/switch is inside a lax.cond/switch at .*{THIS_FILE}",
        ):
            repl.lower(step, _batch(repl.num_replicas))

    def test_reduced_predicate_is_accepted(self, repl):
        def step(b):
            pred = rp.all_max(b["x"].sum()) > 0
            return lax.cond(pred, lambda: rp.all_sum(b["x"]), lambda: b["x"])

        repl.lower(step, _batch(repl.num_replicas))

    def test_predicate_varying_across_workers_allows_collective_within_worker(self, repl2d):
        if repl2d.num_workers < 2:
            pytest.skip("needs two workers")

        def step(b):
            pred = rp.all_sum(b["x"].sum(), group="cores") > 0  # same within a worker
            return lax.cond(pred, lambda: rp.all_sum(b["x"], group="cores"), lambda: b["x"])

        repl2d.lower(step, _batch(repl2d.num_replicas))

        def bad(b):
            pred = rp.all_sum(b["x"].sum(), group="cores") > 0
            return lax.cond(pred, lambda: rp.all_sum(b["x"]), lambda: b["x"])

        with pytest.raises(rp.DivergentControlFlowError, match="workers"):
            repl2d.lower(bad, _batch(repl2d.num_replicas))

    def test_replica_id_alone_under_varying_cond_is_fine(self, repl):
        def step(b):
            return lax.cond(b["x"][0, 0] > 0, lambda: rp.replica_id(), lambda: 0)

        repl.lower(step, _batch(repl.num_replicas))


class TestDivergentState:
    def test_unaveraged_gradient_update_is_rejected_naming_the_leaf(self, repl):
        def step(s, b):
            g = jax.grad(lambda w: jnp.sum(b["x"] @ w))(s["w"])
            return {"w": s["w"] - g, "step": s["step"] + 1}, {}

        state = {"step": jnp.int32(0), "w": jnp.zeros(3)}
        with pytest.raises(rp.DivergentStateError) as err:
            repl.lower(step, _batch(repl.num_replicas), state)
        msg = str(err.value)
        assert "state['w']" in msg and "all_mean" in msg and THIS_FILE in msg

    def test_averaged_gradient_update_is_accepted(self, repl):
        def step(s, b):
            g = jax.grad(lambda w: jnp.sum(b["x"] @ w))(s["w"])
            return {"w": s["w"] - rp.all_mean(g)}, {"per_replica": g}

        repl.lower(step, _batch(repl.num_replicas), {"w": jnp.zeros(3)})

    def test_disabling_the_check_lets_the_step_through(self, n_devices):
        r = rp.Replicator(1, n_devices, passes=Pipeline(disable=["check-replica-invariance"]))
        r.lower(lambda s, b: (s + b["x"].sum(), {}), _batch(n_devices), jnp.float32(0))
