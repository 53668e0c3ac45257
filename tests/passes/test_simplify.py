"""simplify: duplicate collectives merged, invariant ones made local, dead ones dropped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.extend.core import DropVar, Var
from utils import check_against_simulation, sum_rounding_scale

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.core.primitives import PLACEHOLDERS
from replicator.passes import PassManager, Simplify, count_primitives, default_passes, verify_graph

# With a single replica every value is replica-invariant: nothing here would be kept.
pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs at least two replicas")

PLACEHOLDER_NAMES = sorted(p.name for p in PLACEHOLDERS)
ALL_REDUCE = "rp.all_reduce"


def _batch(n, cols=3, seed=0):
    return {"x": np.random.default_rng(seed).normal(size=(2 * n, cols)).astype(np.float32)}


def _state(seed=1):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32), "count": jnp.int32(3)}


def _placeholders(graph):
    return count_primitives(graph.jaxpr, PLACEHOLDER_NAMES)


def _simplify(repl, fn, batch, state=None, **config):
    """The traced graph of ``fn`` and the result of Simplify on it (type-checked)."""
    graph = repl.lower(fn, batch, state).traced
    result = Simplify(**config).run(graph)
    verify_graph(result.graph, lowered=False)
    return graph, result


def _outputs(graph):
    return graph.jaxpr.jaxpr.outvars[graph.num_state :]


def _simplify_first(simplify):
    """The default passes with ``simplify`` before the check (after any pass that must come first)."""
    passes = default_passes()
    passes.insert([p.name for p in passes].index("check-replica-invariance"), simplify)
    return passes


_SIMPLIFYING: dict = {}


def _with_simplify(repl):
    key = (repl.num_workers, repl.cores_per_worker)
    if key not in _SIMPLIFYING:
        pipeline = PassManager(_simplify_first(Simplify()), verify=True)
        _SIMPLIFYING[key] = rp.Replicator(*key, passes=pipeline)
    return _SIMPLIFYING[key]


def _assert_same_results(repl, step, batch, state=None):
    """Run ``step`` with simplify (first, then the default passes) and compare with the vmap reference.

    Worker w's batch is ``batch + 10 w``. The reference (``tests.utils.simulate``)
    runs every replica at once with ``jax.vmap`` and ``jax.lax`` collectives, none
    of the library's passes or lowering: agreement to 1e-6 (relative and absolute).
    """
    shifted = [jax.tree.map(lambda a, w=w: a + np.float32(10 * w), batch) for w in range(repl.num_workers)]
    global_batch = jax.tree.map(lambda *a: np.concatenate(a), *shifted)
    check_against_simulation(_with_simplify(repl), step, [global_batch], state, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------
# dedup
# ----------------------------------------------------------------------------


class TestDedup:
    def test_all_mean_twice_is_computed_once(self, repl):
        def step(b):
            return {"a": rp.all_mean(b["x"]), "b": rp.all_mean(b["x"]) * 2}

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert _placeholders(before) == {ALL_REDUCE: 2}
        assert result.changed and _placeholders(result.graph) == {ALL_REDUCE: 1}
        (eqn,) = [e for e in result.graph.jaxpr.jaxpr.eqns if e.primitive.name == ALL_REDUCE]
        a, _ = _outputs(result.graph)
        assert a is eqn.outvars[0]
        _assert_same_results(repl, step, _batch(repl.num_replicas))

    def test_different_params_or_operands_are_kept(self, repl):
        def step(b):
            x = b["x"]
            return rp.all_mean(x), rp.all_sum(x), rp.all_mean(x, group="cores"), rp.all_mean(x * 2), rp.all_max(x)

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert not result.changed and result.graph is before
        assert _placeholders(before) == {ALL_REDUCE: 5}

    def test_same_operand_tuple_only(self, repl):
        def step(b):
            x, y = b["x"], b["x"] + 1
            p = rp.all_sum((x, y))
            q = rp.all_sum((x, y))
            r = rp.all_sum((y, x))  # another order: another collective
            return p, q, r

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert _placeholders(before) == {ALL_REDUCE: 3}
        assert _placeholders(result.graph) == {ALL_REDUCE: 2}
        outs = _outputs(result.graph)
        assert outs[0] is outs[2] and outs[1] is outs[3]
        _assert_same_results(repl, step, _batch(repl.num_replicas))

    def test_all_gather_broadcast_and_replica_id_are_deduplicated(self, repl):
        def step(b):
            x = b["x"]
            return (
                rp.all_gather(x, tiled=True),
                rp.all_gather(x, tiled=True),
                rp.all_gather(x),  # not tiled: kept
                rp.broadcast(x, source=1),
                rp.broadcast(x, source=1),
                rp.replica_id(),
                rp.replica_id(),
            )

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert _placeholders(before) == {"rp.all_gather": 3, "rp.broadcast": 2, "rp.replica_id": 2}
        assert _placeholders(result.graph) == {"rp.all_gather": 2, "rp.broadcast": 1, "rp.replica_id": 1}
        _assert_same_results(repl, step, _batch(repl.num_replicas))

    def test_a_dropped_first_result_is_revived(self, repl):
        def step(b):
            x, y = b["x"], b["x"] + 1
            first, _ = rp.all_mean((x, y))
            _, second = rp.all_mean((x, y))
            return first, second

        graph = repl.lower(step, _batch(repl.num_replicas)).traced
        jaxpr = graph.jaxpr.jaxpr
        # As after JAX's own DCE: the first collective's unused result is a DropVar.
        index = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == ALL_REDUCE)
        first = jaxpr.eqns[index]
        dropped = first.replace(outvars=[first.outvars[0], DropVar(first.outvars[1].aval)])
        eqns = [*jaxpr.eqns[:index], dropped, *jaxpr.eqns[index + 1 :]]
        graph = graph.with_jaxpr(jax.extend.core.ClosedJaxpr(jaxpr.replace(eqns=eqns), graph.jaxpr.consts))
        verify_graph(graph, lowered=False)

        result = Simplify().run(graph)
        verify_graph(result.graph, lowered=False)
        (eqn,) = [e for e in result.graph.jaxpr.jaxpr.eqns if e.primitive.name == ALL_REDUCE]
        assert all(type(v) is Var for v in eqn.outvars)
        assert list(_outputs(result.graph)) == list(eqn.outvars)

    def test_inside_cond_dedup_stays_within_the_branch(self, repl):
        def step(s, b):
            x = b["x"]
            outside = rp.all_mean(x)
            inside = lax.cond(s["count"] > 0, lambda: rp.all_mean(x) + rp.all_mean(x), lambda: x)
            return s, (outside, inside)

        before, result = _simplify(repl, step, _batch(repl.num_replicas), _state())
        assert _placeholders(before) == {ALL_REDUCE: 3}
        assert _placeholders(result.graph) == {ALL_REDUCE: 2}
        top = result.graph.jaxpr.jaxpr
        assert sum(e.primitive.name == ALL_REDUCE for e in top.eqns) == 1
        (cond,) = [e for e in top.eqns if e.primitive.name == "cond"]
        per_branch = sorted(count_primitives(b.jaxpr, [ALL_REDUCE]).get(ALL_REDUCE, 0) for b in cond.params["branches"])
        assert per_branch == [0, 1]
        _assert_same_results(repl, step, _batch(repl.num_replicas), _state())

    def test_can_be_switched_off(self, repl):
        def step(b):
            return rp.all_mean(b["x"]), rp.all_mean(b["x"])

        _, result = _simplify(repl, step, _batch(repl.num_replicas), dedup=False)
        assert not result.changed and _placeholders(result.graph) == {ALL_REDUCE: 2}


# ----------------------------------------------------------------------------
# invariant
# ----------------------------------------------------------------------------


class TestInvariant:
    def test_all_sum_of_state_becomes_a_multiply(self, repl):
        n = repl.num_replicas

        def step(s, b):
            return s, rp.all_sum({"w": s["w"], "count": s["count"]})

        before, result = _simplify(repl, step, _batch(n), _state())
        assert _placeholders(before) == {ALL_REDUCE: 1}  # one all_reduce of both leaves
        assert _placeholders(result.graph) == {}
        muls = [e for e in result.graph.jaxpr.jaxpr.eqns if e.primitive.name == "mul"]
        assert sorted(float(e.invars[1].val) for e in muls) == [n, n]
        count, w = _outputs(result.graph)  # leaves in key order
        assert w.aval.dtype == jnp.float32 and count.aval.dtype == jnp.int32
        _assert_same_results(repl, step, _batch(n), _state())

    def test_mean_max_min_broadcast_of_an_invariant_value_are_identities(self, repl):
        def step(b):
            m = rp.all_mean(b["x"])
            return m, rp.all_mean(m), rp.all_max(m), rp.all_min(m), rp.broadcast(m, source=1)

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert _placeholders(before) == {ALL_REDUCE: 4, "rp.broadcast": 1}
        assert _placeholders(result.graph) == {ALL_REDUCE: 1}
        outs = _outputs(result.graph)
        assert all(o is outs[0] for o in outs)
        _assert_same_results(repl, step, _batch(repl.num_replicas))

    @pytest.mark.parametrize("tiled", [False, True])
    @pytest.mark.parametrize("axis", [0, 1])
    def test_all_gather_of_an_invariant_value_is_a_broadcast(self, repl, tiled, axis):
        n = repl.num_replicas

        def step(s, b):
            return s, rp.all_gather(s["w"], axis=axis, tiled=tiled)

        before, result = _simplify(repl, step, _batch(n), _state())
        assert _placeholders(before) == {"rp.all_gather": 1}
        assert _placeholders(result.graph) == {}
        (bcast,) = [e for e in iter_eqns(result.graph.jaxpr.jaxpr) if e.primitive.name == "broadcast_in_dim"]
        stacked = [2, 3]
        stacked.insert(axis, n)
        assert bcast.outvars[0].aval.shape == tuple(stacked)
        (out,) = _outputs(result.graph)
        expected = [2, 3]
        if tiled:
            expected[axis] *= n
        else:
            expected.insert(axis, n)
        assert out.aval.shape == tuple(expected)
        _assert_same_results(repl, step, _batch(n), _state())

    @pytest.mark.parametrize("group", [None, "cores", "workers"])
    def test_reduce_scatter_of_an_invariant_value_takes_my_chunk(self, repl2d, group):
        n = repl2d.context.group_size(group)

        def step(s, b):
            big = jnp.concatenate([s["w"] * (i + 1) for i in range(n)], axis=1)  # (2, 3 n)
            return s, rp.reduce_scatter(big, axis=1, group=group)

        before, result = _simplify(repl2d, step, _batch(repl2d.num_replicas), _state())
        assert _placeholders(before) == {"rp.reduce_scatter": 1}
        assert _placeholders(result.graph) == ({"rp.replica_id": 1} if n > 1 else {})
        _assert_same_results(repl2d, step, _batch(repl2d.num_replicas), _state())

    def test_collectives_of_batch_data_are_kept(self, repl):
        def step(b):
            x = b["x"]
            return (
                rp.all_sum(x),
                rp.all_mean(x * 2),
                rp.all_max(x + 1),
                rp.all_gather(x),
                rp.broadcast(x - 1),
                rp.reduce_scatter(jnp.tile(x, (repl.num_replicas, 1))),
                rp.all_sum(x + rp.replica_id()),
            )

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert not result.changed and result.graph is before

    def test_results_of_host_callbacks_are_not_trusted_to_be_invariant(self, repl):
        spec = jax.ShapeDtypeStruct((), jnp.float32)

        def step(b):
            mine = io_callback(lambda: np.float32(np.random.rand()), spec)  # may differ per replica
            pure = jax.pure_callback(lambda: np.float32(1), spec)
            return rp.all_sum(mine), rp.all_sum(pure), rp.all_sum(mine + 1)

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert not result.changed and _placeholders(result.graph) == {ALL_REDUCE: 3}

    def test_only_invariant_operands_of_an_all_reduce_are_made_local(self, repl):
        def step(s, b):
            w, x = rp.all_sum((s["w"], b["x"]))
            return s, (w, x)

        before, result = _simplify(repl, step, _batch(repl.num_replicas), _state())
        (eqn,) = [e for e in iter_eqns(result.graph.jaxpr.jaxpr) if e.primitive.name == ALL_REDUCE]
        assert len(eqn.invars) == 1 and eqn.invars[0] is before.jaxpr.jaxpr.invars[-1]
        _assert_same_results(repl, step, _batch(repl.num_replicas), _state())

    def test_within_a_worker_invariant_is_simplified_only_within_the_worker(self, repl2d):
        if repl2d.num_workers < 2:
            pytest.skip("needs two workers")
        cores = repl2d.cores_per_worker

        def step(b):
            y = rp.all_sum(b["x"], group="cores")  # same within a worker, not across workers
            return (
                rp.all_sum(y, group="cores"),
                rp.all_mean(y, group="cores"),
                rp.all_sum(y),
                rp.all_sum(y, group="workers"),
            )

        before, result = _simplify(repl2d, step, _batch(repl2d.num_replicas))
        assert _placeholders(before) == {ALL_REDUCE: 5}
        eqns = [e for e in iter_eqns(result.graph.jaxpr.jaxpr) if e.primitive.name == ALL_REDUCE]
        # With one core per worker, a collective over 'cores' is a no-op, even of batch data.
        kept = ["None", "cores", "workers"] if cores > 1 else ["None", "workers"]
        assert sorted(str(e.params["group"]) for e in eqns) == kept
        muls = [e for e in result.graph.jaxpr.jaxpr.eqns if e.primitive.name == "mul"]
        assert [float(m.invars[1].val) for m in muls] == ([cores] if cores > 1 else [])
        _assert_same_results(repl2d, step, _batch(repl2d.num_replicas))

    def test_inside_scan_and_while_bodies(self, repl):
        def step(s, b):
            def scan_body(c, row):
                return c + rp.all_sum(c), rp.all_sum(row)  # carry stays invariant; rows vary

            c, ys = lax.scan(scan_body, s["w"][0], b["x"])

            def varying_body(carry):
                i, v = carry
                return i + 1, rp.all_sum(v) * 0.5 + b["x"][0]  # the carry picks up batch data

            _, v = lax.while_loop(lambda carry: carry[0] < 2, varying_body, (0, s["w"][0]))
            _, u = lax.while_loop(lambda carry: carry[0] < 2, lambda c: (c[0] + 1, rp.all_mean(c[1])), (0, c))
            return s, (c, ys, v, u)

        before, result = _simplify(repl, step, _batch(repl.num_replicas), _state())
        assert _placeholders(before) == {ALL_REDUCE: 4}
        loops = [e for e in result.graph.jaxpr.jaxpr.eqns if e.primitive.name in ("scan", "while")]
        remaining = [count_primitives(e.params.get("jaxpr", e.params.get("body_jaxpr"))) for e in loops]
        assert [r.get(ALL_REDUCE, 0) for r in remaining] == [1, 1, 0]
        assert remaining[0].get("mul", 0) >= 1
        _assert_same_results(repl, step, _batch(repl.num_replicas), _state())

    @pytest.mark.parametrize(
        "container", ["jit", "cond", "scan", "while", "remat2", "custom_jvp_call", "custom_vjp_call"]
    )
    def test_in_every_kind_of_sub_jaxpr(self, repl, container):
        def body(w, x):  # one collective made local, one deduplicated, one kept
            return rp.all_sum(w) + rp.all_mean(x) * rp.all_mean(x)

        def step(s, b):
            w, x = s["w"], b["x"][:2]
            if container == "jit":
                out = jax.jit(body)(w, x)
            elif container == "cond":
                out = lax.cond(s["count"] > 0, body, lambda w, x: w, w, x)
            elif container == "scan":
                out = lax.scan(lambda c, _: (body(c, x) * 0.5, None), w, None, length=2)[0]
            elif container == "while":
                out = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, body(w, c[1])), (0, x))[1]
            elif container == "remat2":
                out = jax.grad(lambda v: jnp.sum(jax.checkpoint(lambda u: jnp.sin(body(u, x)))(v)))(w)
            elif container == "custom_jvp_call":
                f = jax.custom_jvp(body)
                f.defjvp(lambda p, t: (f(*p), t[0]))
                out = f(w, x)
            else:
                f = jax.custom_vjp(body)
                f.defvjp(lambda w, x: (f(w, x), None), lambda _, ct: (ct, ct))
                out = f(w, x)
            return s, out

        before, result = _simplify(repl, step, _batch(repl.num_replicas), _state())
        assert container in count_primitives(before.jaxpr)
        assert _placeholders(before)[ALL_REDUCE] >= 3
        assert _placeholders(result.graph) == {ALL_REDUCE: 1}  # all_mean(x), once
        _assert_same_results(repl, step, _batch(repl.num_replicas), _state())

    def test_literals_and_num_replicas(self, repl):
        n = repl.num_replicas

        def step(b):
            return {
                "n": rp.all_sum(1.0),
                "same": rp.all_mean(2.0),
                "k": jnp.float32(rp.num_replicas()) * rp.all_max(b["x"]).sum(),
            }

        before, result = _simplify(repl, step, _batch(n))
        assert _placeholders(before) == {ALL_REDUCE: 3}
        assert _placeholders(result.graph) == {ALL_REDUCE: 1}
        _assert_same_results(repl, step, _batch(n))

    def test_a_training_step_keeps_only_the_gradient_mean(self, repl):
        def step(s, b):
            def loss(w):
                return jnp.mean((b["x"] @ w.T) ** 2)

            value, grads = jax.value_and_grad(loss)(s["w"])
            grads = rp.all_mean(grads)
            again = rp.all_mean(grads)  # invariant already
            w = s["w"] - 0.1 * again
            return {"w": w, "count": s["count"] + rp.all_sum(jnp.int32(1))}, {
                "loss": rp.all_mean(value),
                "norm": rp.all_sum(jnp.sum(w**2)),
            }

        before, result = _simplify(repl, step, _batch(repl.num_replicas), _state())
        assert _placeholders(before) == {ALL_REDUCE: 5}
        assert _placeholders(result.graph) == {ALL_REDUCE: 2}  # the gradients and the loss
        _assert_same_results(repl, step, _batch(repl.num_replicas), _state())

    def test_divergent_control_flow_disables_only_the_invariant_rewrite(self, n_devices):
        repl = rp.Replicator(1, n_devices, passes=PassManager(disable=["check-replica-invariance"]))

        def step(s, b):
            w = s["w"]
            return s, lax.cond(b["x"].sum() > 0, lambda: rp.all_sum(w) + rp.all_sum(w), lambda: w)

        _, result = _simplify(repl, step, _batch(n_devices), _state())
        assert _placeholders(result.graph) == {ALL_REDUCE: 1}  # deduplicated, not made local

    def test_can_be_switched_off(self, repl):
        def step(s, b):
            return s, rp.all_sum(s["w"])

        _, result = _simplify(repl, step, _batch(repl.num_replicas), _state(), invariant=False)
        assert not result.changed


# ----------------------------------------------------------------------------
# dead
# ----------------------------------------------------------------------------


class TestDead:
    def test_an_unused_collective_and_what_only_fed_it_are_removed(self, repl):
        def step(b):
            rp.all_sum(jnp.sin(b["x"]))
            rp.all_gather(b["x"])
            return b["x"] * 2

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert _placeholders(before) == {ALL_REDUCE: 1, "rp.all_gather": 1}
        assert result.changed and _placeholders(result.graph) == {}
        assert "sin" not in count_primitives(result.graph.jaxpr)
        _assert_same_results(repl, step, _batch(repl.num_replicas))

    def test_inside_a_branch(self, repl):
        def step(s, b):
            def branch():
                rp.all_sum(b["x"])
                return b["x"] + 1

            return s, lax.cond(s["count"] > 0, branch, lambda: b["x"])

        before, result = _simplify(repl, step, _batch(repl.num_replicas), _state())
        assert _placeholders(before) == {ALL_REDUCE: 1}
        assert _placeholders(result.graph) == {}
        _assert_same_results(repl, step, _batch(repl.num_replicas), _state())

    def test_effects_are_kept(self, repl):
        def step(b):
            jax.debug.callback(lambda v: None, rp.all_sum(b["x"]))
            rp.all_max(b["x"])
            return b["x"]

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert _placeholders(result.graph) == {ALL_REDUCE: 1}
        assert count_primitives(result.graph.jaxpr, ["debug_callback"]) == {"debug_callback": 1}

    def test_can_be_switched_off(self, repl):
        def step(b):
            rp.all_sum(b["x"])
            return b["x"]

        _, result = _simplify(repl, step, _batch(repl.num_replicas), dead=False)
        assert not result.changed and _placeholders(result.graph) == {ALL_REDUCE: 1}


# ----------------------------------------------------------------------------
# the pass
# ----------------------------------------------------------------------------


class TestPass:
    def test_repr_is_the_configuration_and_keys_the_cache(self):
        assert repr(Simplify()) == "Simplify(dedup=True, invariant=True, dead=True)"
        assert repr(Simplify(dead=False)) == "Simplify(dedup=True, invariant=True, dead=False)"
        keys = {PassManager(_simplify_first(p)).key() for p in (Simplify(), Simplify(dedup=False), Simplify())}
        assert len(keys) == 2

    def test_pure_and_idempotent(self, repl):
        def step(s, b):
            m = rp.all_mean(b["x"])
            return s, (m, rp.all_mean(b["x"]), rp.all_sum(s["w"]), rp.all_mean(m), rp.all_mean(1.0))

        graph = repl.lower(step, _batch(repl.num_replicas), _state()).traced
        text = str(graph.jaxpr)
        result = Simplify().run(graph)
        assert result.changed and str(graph.jaxpr) == text
        again = Simplify().run(result.graph)
        assert not again.changed and again.graph is result.graph

    def test_in_the_default_pipeline_and_disableable(self, n_devices):
        step = lambda b: (rp.all_mean(b["x"]), rp.all_mean(b["x"]))  # noqa: E731
        lowered = rp.Replicator(1, n_devices).lower(step, _batch(n_devices))
        assert "simplify" in [s.name for s in lowered.snapshots]
        assert count_primitives(lowered.after("simplify").jaxpr, [ALL_REDUCE]) == {ALL_REDUCE: 1}
        assert count_primitives(lowered.final.jaxpr, ["psum"]) == {"psum": 1}
        # Without simplify (and without fusion, which would merge them) both stay.
        off = rp.Replicator(1, n_devices, passes=PassManager(disable=["simplify", "fuse-collectives"])).lower(
            step, _batch(n_devices)
        )
        assert count_primitives(off.final.jaxpr, ["psum"]) == {"psum": 2}


# ----------------------------------------------------------------------------
# Just outside the preconditions: left alone
# ----------------------------------------------------------------------------


def _unchecked(n_devices):
    """A replicator whose pipeline skips check-replica-invariance (as its errors suggest)."""
    pipeline = PassManager.default(shard_optimizer=False, disable=["check-replica-invariance"], verify=True)
    return rp.Replicator(1, n_devices, passes=pipeline)


def _solve_step(s, b):
    """A collective inside ``custom_linear_solve``, a primitive the variance analysis has no rule for."""
    x = b["x"][0]  # this replica's first row

    def matvec(v):
        return rp.all_mean(v) * 2.0 + v

    y = lax.custom_linear_solve(matvec, x, lambda mv, r: mv(r))  # "solves" by applying matvec: 2 mean(x) + x
    return s, (y, rp.all_sum(s["w"]))


class TestOutsideThePreconditions:
    def test_an_unanalyzable_step_gets_no_invariant_rewrite(self, n_devices):
        """Regression: simplify raised UnanalyzableStepError when the check was disabled.

        ``all_sum(s['w'])`` is of state, but the analysis cannot run on this step, so
        nothing proves it: it stays a collective; dedup and dead code still apply.
        """
        repl = _unchecked(n_devices)
        before, result = _simplify(repl, _solve_step, _batch(n_devices), _state())
        # all_mean in the matvec and in the solve (which applies it), all_sum outside.
        assert count_primitives(before.jaxpr, [ALL_REDUCE, "custom_linear_solve"]) == {
            ALL_REDUCE: 3,
            "custom_linear_solve": 1,
        }
        assert count_primitives(result.graph.jaxpr) == count_primitives(before.jaxpr)
        assert not result.changed

    def test_an_unanalyzable_step_runs_and_matches_numpy(self, n_devices):
        """Regression: the whole pipeline on that step (lowering rebuilt custom_linear_solve's
        named tuple of jaxprs as a plain tuple: AttributeError 'tuple' object has no attribute 'solve')."""
        batch, state = _batch(n_devices), _state()

        def input_fn(ctx):
            while True:
                yield batch

        _, (y, total) = _unchecked(n_devices).run(_solve_step, input_fn, state)
        rows = batch["x"][::2].astype(np.float64)  # replica r's first row
        rtol = 1e-6 * sum_rounding_scale(n_devices)
        np.testing.assert_allclose(np.asarray(y), 2 * rows.mean(0) + rows, rtol=rtol)
        np.testing.assert_allclose(
            np.asarray(total), np.broadcast_to(n_devices * np.asarray(state["w"]), (n_devices, 2, 3)), rtol=rtol
        )

    def test_dedup_stays_out_of_a_while_body(self, repl):
        """The same collective of the same value inside and outside a loop body: two regions, both kept."""

        def step(b):
            x = b["x"]
            outside = rp.all_mean(x)
            _, inside = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + rp.all_mean(x)), (0, x))
            return outside, inside

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert count_primitives(before.jaxpr, [ALL_REDUCE]) == {ALL_REDUCE: 2}
        assert not result.changed and result.graph is before

    def test_a_value_identical_within_workers_is_not_made_local_over_every_replica(self, repl2d):
        """Invariant along 'cores' only: all_gather/reduce_scatter/broadcast over everyone stay collectives."""
        if repl2d.num_workers < 2:
            pytest.skip("needs two workers")
        n = repl2d.num_replicas

        def step(b):
            y = rp.all_sum(b["x"], group="cores")  # (2, 3): same within a worker only
            return rp.all_gather(y), rp.reduce_scatter(jnp.tile(y, (n, 1))), rp.broadcast(y, source=n - 1)

        before, result = _simplify(repl2d, step, _batch(n))
        assert not result.changed and result.graph is before
        _assert_same_results(repl2d, step, _batch(n))

    def test_per_device_random_numbers_are_not_assumed_identical(self, repl):
        def step(b):
            u = lax.rng_uniform(0.0, 1.0, (2,))  # differs between devices
            return u, rp.all_mean(u)

        before, result = _simplify(repl, step, _batch(repl.num_replicas))
        assert count_primitives(result.graph.jaxpr, [ALL_REDUCE]) == count_primitives(before.jaxpr, [ALL_REDUCE])
